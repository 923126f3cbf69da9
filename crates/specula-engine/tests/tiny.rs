//! Loader, forward-pass, KV-rollback and emit-step tests on tiny random models written in the
//! test (GGUF and Hugging Face layouts).

use candle_core::quantized::GgmlDType;
use candle_core::Device;
use specula_engine::bundle;
use specula_engine::emit::Emitter;
use specula_engine::model::{Family, LogitsRows, Model, Segment};
use specula_engine::testing::{write_tiny_gguf, write_tiny_hf, TinySpec};
use specula_engine::{Engine, FinishReason, GenerateRequest, LoadOptions, SamplingParams};

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

fn load_gguf(spec: &TinySpec, dir: &std::path::Path) -> Model {
    let path = dir.join("tiny.gguf");
    write_tiny_gguf(&path, spec).expect("write gguf");
    bundle::load(&path, &Device::Cpu).expect("load gguf").model
}

fn all_logits(model: &Model, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut kv = model.new_kv_cache();
    model
        .forward(tokens, &mut kv, LogitsRows::All, &[])
        .expect("forward")
        .logits
        .to_vec2()
        .expect("logits")
}

const TOKENS: [u32; 12] = [258, 40, 72, 101, 259, 32, 116, 104, 257, 10, 65, 99];

#[test]
fn hf_bundle_equals_gguf_for_every_family() {
    for family in [Family::Llama, Family::Qwen2, Family::Qwen3] {
        let dir = tmp();
        let spec = TinySpec::new(family);
        let g = load_gguf(&spec, dir.path());
        write_tiny_hf(&dir.path().join("hf"), &spec).expect("write hf");
        let h = bundle::load(&dir.path().join("hf"), &Device::Cpu)
            .expect("load hf")
            .model;
        let (a, b) = (all_logits(&g, &TOKENS), all_logits(&h, &TOKENS));
        assert_eq!(a.len(), TOKENS.len());
        let mut max = 0f32;
        for (ra, rb) in a.iter().zip(&b) {
            for (x, y) in ra.iter().zip(rb) {
                max = max.max((x - y).abs());
            }
        }
        // Same f32 weights; Llama's q/k rows are permuted in GGUF (interleaved RoPE), which only
        // reorders the matmul's output columns.
        assert!(max < 1e-4, "{family:?}: GGUF and HF logits differ by {max}");
        let spread = a[0].iter().cloned().fold(f32::MIN, f32::max) - a[0].iter().cloned().fold(f32::MAX, f32::min);
        assert!(spread > 0.1, "{family:?}: logits are degenerate");
    }
}

/// Logits of row i of an n-row forward are bitwise equal to a one-row forward at that position,
/// for the quantized types our own kernels compute (the 32-wide block types and the K-quants).
#[test]
fn verify_rows_equal_decode_rows_bitwise() {
    for dtype in [
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
        GgmlDType::Q8_0,
        GgmlDType::Q2K,
        GgmlDType::Q3K,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
    ] {
        for family in [Family::Llama, Family::Qwen2, Family::Qwen3] {
            let dir = tmp();
            let spec = TinySpec::with_dtype(family, dtype);
            let model = load_gguf(&spec, dir.path());
            assert!(model.batch_invariant(), "{dtype:?} {family:?}: not on our kernels");
            let prefix = &TOKENS[..4];
            let block = &TOKENS[4..];
            let mut kv = model.new_kv_cache();
            model.forward(prefix, &mut kv, LogitsRows::None, &[]).expect("prefill");
            let many: Vec<Vec<f32>> = model
                .forward(block, &mut kv, LogitsRows::All, &[])
                .expect("verify")
                .logits
                .to_vec2()
                .expect("rows");
            kv.truncate(prefix.len());
            for (i, &t) in block.iter().enumerate() {
                let one: Vec<Vec<f32>> = model
                    .forward(&[t], &mut kv, LogitsRows::All, &[])
                    .expect("decode")
                    .logits
                    .to_vec2()
                    .expect("row");
                let a: Vec<u32> = many[i].iter().map(|x| x.to_bits()).collect();
                let b: Vec<u32> = one[0].iter().map(|x| x.to_bits()).collect();
                assert!(
                    a == b,
                    "{dtype:?} {family:?}: row {i} of a {}-row forward differs from decode",
                    block.len()
                );
            }
        }
    }
}

/// A batched forward over several sequences (different lengths, positions, logits rows) gives
/// each sequence the bits of its own forward, and leaves each cache as its own forward would.
#[test]
fn batched_forward_equals_separate_forwards_bitwise() {
    let bits = |t: &candle_core::Tensor| -> Vec<Vec<u32>> {
        let rows: Vec<Vec<f32>> = t.to_vec2().expect("rows");
        rows.iter().map(|r| r.iter().map(|x| x.to_bits()).collect()).collect()
    };
    for dtype in [GgmlDType::Q4_1, GgmlDType::Q8_0, GgmlDType::Q4K, GgmlDType::Q6K] {
        for family in [Family::Llama, Family::Qwen2, Family::Qwen3] {
            let dir = tmp();
            let model = load_gguf(&TinySpec::with_dtype(family, dtype), dir.path());
            // Three sequences with different prefixes already in their caches.
            let prefixes: [&[u32]; 3] = [&TOKENS[..3], &TOKENS[2..9], &TOKENS[5..6]];
            let steps: [(&[u32], LogitsRows); 3] = [
                (&TOKENS[3..4], LogitsRows::Last),
                (&TOKENS[1..6], LogitsRows::All),
                (&TOKENS[6..9], LogitsRows::None),
            ];
            let mut solo = Vec::new();
            let mut caches = Vec::new();
            for (p, (t, rows)) in prefixes.iter().zip(steps) {
                let mut kv = model.new_kv_cache();
                model.forward(p, &mut kv, LogitsRows::None, &[]).expect("prefill");
                caches.push(kv.clone());
                let out = model.forward(t, &mut kv, rows, &[1]).expect("solo");
                solo.push((bits(&out.logits), bits(&out.hidden[0]), kv));
            }
            let mut segs: Vec<Segment> = caches
                .iter_mut()
                .zip(steps)
                .map(|(kv, (tokens, rows))| Segment { tokens, kv, rows })
                .collect();
            let outs = model.forward_batch(&mut segs, &[1]).expect("batched");
            drop(segs);
            for (i, (out, (logits, hidden, kv))) in outs.iter().zip(&solo).enumerate() {
                assert_eq!(&bits(&out.logits), logits, "{dtype:?} {family:?}: segment {i} logits");
                assert_eq!(
                    &bits(&out.hidden[0]),
                    hidden,
                    "{dtype:?} {family:?}: segment {i} hidden"
                );
                let (k1, v1) = kv.layer_vecs(0, kv.len());
                let (k2, v2) = caches[i].layer_vecs(0, caches[i].len());
                assert_eq!((k1, v1), (k2, v2), "{dtype:?} {family:?}: segment {i} cache");
            }
        }
    }
}

/// `Engine::step` over several sequences: prompt rows per step stay within the prefill budget
/// (a running stream keeps decoding while others prefill), and each output equals its solo run.
#[test]
fn stepping_sequences_together_budgets_prefill_and_matches_solo_runs() {
    let dir = tmp();
    let path = dir.path().join("tiny.gguf");
    write_tiny_gguf(&path, &TinySpec::with_dtype(Family::Qwen2, GgmlDType::Q8_0)).expect("write");
    let opts = || LoadOptions {
        prefill_chunk: 8,
        ..LoadOptions::default()
    };
    let mut e = Engine::load(&path, "tiny", opts()).expect("load");
    let req = |n: usize, salt: u32| GenerateRequest {
        prompt_tokens: (0..n as u32).map(|i| 97 + (i * 7 + salt) % 26).collect(),
        sampling: SamplingParams::greedy(),
        max_tokens: Some(12),
        stop: vec![],
        logprobs: None,
        ignore_eos: true,
        spec: Default::default(),
    };
    let reqs = [req(3, 0), req(30, 1), req(21, 2)];
    let solo: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| e.generate(r, &mut |_| true).expect("solo").token_ids)
        .collect();
    let mut seqs: Vec<_> = reqs.iter().map(|r| e.start_sequence(r, None).expect("start")).collect();
    let mut steps = 0;
    while seqs.iter().any(|s| s.finished().is_none()) {
        let before: Vec<usize> = seqs.iter().map(|s| s.kv().len()).collect();
        let prefilling: Vec<bool> = seqs.iter().map(|s| s.is_prefilling()).collect();
        let mut refs: Vec<_> = seqs.iter_mut().collect();
        for r in e.step(&mut refs) {
            r.expect("step");
        }
        let fed: Vec<usize> = seqs
            .iter()
            .zip(&before)
            .map(|(s, b)| s.kv().len().saturating_sub(*b))
            .collect();
        let prompt_rows: usize = fed.iter().zip(&prefilling).filter(|(_, p)| **p).map(|(f, _)| *f).sum();
        assert!(
            prompt_rows <= 8,
            "step {steps}: {prompt_rows} prompt rows > budget ({fed:?})"
        );
        if steps == 1 {
            // The short request decodes while the long ones are still prefilling.
            assert!(!seqs[0].is_prefilling() && fed[0] == 1, "step 1: {fed:?}");
        }
        steps += 1;
        assert!(steps < 200, "no progress");
    }
    for (i, s) in seqs.into_iter().enumerate() {
        let out = e.retire(s, true);
        assert_eq!(out.token_ids, solo[i], "sequence {i}");
    }
}

#[test]
fn kv_truncate_rolls_back_exactly() {
    let dir = tmp();
    let model = load_gguf(
        &TinySpec {
            dtype: GgmlDType::Q8_0,
            ..TinySpec::new(Family::Qwen2)
        },
        dir.path(),
    );
    let mut kv = model.new_kv_cache();
    model.forward(&[1, 2, 3, 4], &mut kv, LogitsRows::None, &[]).expect("a");
    model
        .forward(&[5, 6, 7], &mut kv, LogitsRows::None, &[])
        .expect("rejected draft");
    kv.truncate(4);
    let after = model
        .forward(&[8], &mut kv, LogitsRows::Last, &[])
        .expect("b")
        .logits
        .to_vec2::<f32>()
        .expect("v");
    let mut fresh = model.new_kv_cache();
    model
        .forward(&[1, 2, 3, 4], &mut fresh, LogitsRows::None, &[])
        .expect("a");
    let want = model
        .forward(&[8], &mut fresh, LogitsRows::Last, &[])
        .expect("b")
        .logits
        .to_vec2::<f32>()
        .expect("v");
    assert_eq!(after, want);
    assert_eq!(kv.len(), 5);
}

#[test]
fn hidden_state_taps_have_the_right_shape() {
    let dir = tmp();
    let spec = TinySpec::new(Family::Qwen3);
    let model = load_gguf(&spec, dir.path());
    let mut kv = model.new_kv_cache();
    let out = model
        .forward(&TOKENS[..5], &mut kv, LogitsRows::Last, &[0, 1, 2])
        .expect("forward");
    assert_eq!(out.hidden.len(), 3);
    for h in &out.hidden {
        assert_eq!(h.dims(), &[5, spec.hidden]);
    }
    assert_eq!(out.logits.dims(), &[1, 256 + 4 + 2]);
    assert!(
        model.forward(&[1], &mut kv, LogitsRows::Last, &[9]).is_err(),
        "tap past the last layer is an error"
    );
    assert_eq!(kv.len(), 5, "a failed forward leaves the cache as it was");
}

#[test]
fn forward_rejects_bad_input() {
    let dir = tmp();
    let model = load_gguf(&TinySpec::new(Family::Llama), dir.path());
    let mut kv = model.new_kv_cache();
    assert!(model.forward(&[], &mut kv, LogitsRows::Last, &[]).is_err());
    assert!(model.forward(&[100_000], &mut kv, LogitsRows::Last, &[]).is_err());
    assert_eq!(kv.len(), 0);
}

fn engine(family: Family) -> (tempfile::TempDir, Engine) {
    let dir = tmp();
    let path = dir.path().join("tiny.gguf");
    write_tiny_gguf(
        &path,
        &TinySpec {
            dtype: GgmlDType::Q8_0,
            ..TinySpec::new(family)
        },
    )
    .expect("write");
    let e = Engine::load(&path, "tiny", LoadOptions::default()).expect("load");
    (dir, e)
}

#[test]
fn generation_is_deterministic_and_seeded() {
    let (_d, mut e) = engine(Family::Llama);
    let toks = e.tokenize("the thing").expect("tokenize");
    let req = |sampling| GenerateRequest {
        prompt_tokens: toks.clone(),
        sampling,
        max_tokens: Some(20),
        stop: vec![],
        logprobs: Some(3),
        ignore_eos: true,
        spec: Default::default(),
    };
    let a = e.generate(&req(SamplingParams::greedy()), &mut |_| true).expect("gen");
    let b = e.generate(&req(SamplingParams::greedy()), &mut |_| true).expect("gen");
    assert_eq!(a.token_ids, b.token_ids);
    assert_eq!(a.token_ids.len(), 20);
    assert_eq!(a.finish_reason, FinishReason::Length);
    let lp = a.logprobs.as_ref().expect("logprobs");
    assert_eq!(lp.len(), 20);
    for (l, &t) in lp.iter().zip(&a.token_ids) {
        assert_eq!(l.id, t);
        assert_eq!(l.top.len(), 3);
        assert_eq!(l.top[0].id, t, "greedy picks the top-1 token");
        assert!(l.logprob <= 0.0);
    }
    let seeded = SamplingParams {
        temperature: 1.0,
        seed: Some(42),
        ..SamplingParams::default()
    };
    let s1 = e.generate(&req(seeded.clone()), &mut |_| true).expect("gen");
    let s2 = e.generate(&req(seeded), &mut |_| true).expect("gen");
    assert_eq!(s1.token_ids, s2.token_ids, "same seed, same output");
    let other = SamplingParams {
        temperature: 1.0,
        seed: Some(43),
        ..SamplingParams::default()
    };
    let s3 = e.generate(&req(other), &mut |_| true).expect("gen");
    assert_ne!(
        s1.token_ids, s3.token_ids,
        "another seed gives another sample (random tiny model, 20 tokens)"
    );
}

#[test]
fn streamed_deltas_concatenate_to_the_text_and_cancel_stops() {
    let (_d, mut e) = engine(Family::Qwen2);
    let toks = e.tokenize("in the").expect("tokenize");
    let req = GenerateRequest {
        prompt_tokens: toks,
        sampling: SamplingParams::greedy(),
        max_tokens: Some(30),
        stop: vec![],
        logprobs: None,
        ignore_eos: true,
        spec: Default::default(),
    };
    let mut streamed = String::new();
    let out = e
        .generate(&req, &mut |d| {
            streamed.push_str(&d.text);
            true
        })
        .expect("gen");
    assert_eq!(streamed, out.text);
    let mut n = 0;
    let cancelled = e
        .generate(&req, &mut |_| {
            n += 1;
            n < 3
        })
        .expect("gen");
    assert_eq!(cancelled.finish_reason, FinishReason::Cancelled);
    assert_eq!(cancelled.token_ids.len(), 3);
}

#[test]
fn a_prompt_longer_than_the_context_in_bytes_is_refused_before_tokenizing() {
    let (_d, e) = engine(Family::Llama);
    let ctx = e.context_length();
    let per = e.tokenizer().max_token_bytes();
    assert!(per >= 1);
    // Exactly the bound: at least `ctx` tokens, refused without tokenizing.
    let text = "t".repeat(ctx * per);
    match e.tokenize_prompt(&text) {
        Err(specula_engine::RequestError::PromptTooLongBytes {
            bytes,
            min_tokens,
            context,
        }) => assert_eq!((bytes, min_tokens, context), (ctx * per, ctx, ctx)),
        other => panic!("{other:?}"),
    }
    // One byte per token below the bound it is tokenized (and is then measured in tokens).
    let text = "t".repeat(ctx * per - 1);
    let tokens = e.tokenize_prompt(&text).expect("tokenized");
    // Plain tokenizing has no limit (distillation data files are long).
    let long = e.tokenize(&"t".repeat(ctx * per)).expect("tokenized");
    assert!(long.len() >= ctx);
    assert!(
        tokens.len() * per >= text.len(),
        "no token covers more than {per} bytes"
    );
}

#[test]
fn request_validation_errors() {
    let (_d, mut e) = engine(Family::Llama);
    let ctx = e.context_length();
    let base = GenerateRequest {
        prompt_tokens: vec![1, 2, 3],
        sampling: SamplingParams::greedy(),
        max_tokens: Some(4),
        stop: vec![],
        logprobs: None,
        ignore_eos: false,
        spec: Default::default(),
    };
    let mut r = base.clone();
    r.prompt_tokens = vec![];
    assert!(e.generate(&r, &mut |_| true).is_err());
    let mut r = base.clone();
    r.prompt_tokens = vec![5; ctx];
    assert!(matches!(
        e.generate(&r, &mut |_| true),
        Err(specula_engine::RequestError::PromptTooLong { .. })
    ));
    let mut r = base.clone();
    r.max_tokens = Some(ctx);
    assert!(matches!(
        e.generate(&r, &mut |_| true),
        Err(specula_engine::RequestError::MaxTokensTooLarge { .. })
    ));
    let mut r = base.clone();
    r.sampling.temperature = -1.0;
    assert!(matches!(
        e.generate(&r, &mut |_| true),
        Err(specula_engine::RequestError::InvalidParameter(_))
    ));
    let mut r = base;
    r.prompt_tokens = vec![99_999];
    assert!(matches!(
        e.generate(&r, &mut |_| true),
        Err(specula_engine::RequestError::InvalidParameter(_))
    ));
}

// ---- the emit step, driven token by token with the tiny byte-level tokenizer ----

fn byte_tokens(e: &Engine, s: &str) -> Vec<u32> {
    // One token per byte: the tiny vocabulary's first 256 ids are the GPT-2 byte alphabet.
    let table = specula_engine::tokenizer::bytes_to_unicode();
    s.bytes()
        .map(|b| {
            e.tokenizer()
                .token_to_id(&table[b as usize].to_string())
                .expect("byte token")
        })
        .collect()
}

#[test]
fn emit_stop_string_spanning_tokens_is_cut_and_held_back() {
    let (_d, e) = engine(Family::Llama);
    let eos = e.eos_ids().to_vec();
    let toks = byte_tokens(&e, "abcSTOPdef");
    let mut em = Emitter::new(e.tokenizer(), &eos, vec!["STOP".into()], false, 100);
    let mut streamed = String::new();
    for (i, &t) in toks.iter().enumerate() {
        let o = em.emit_block(&[t], None);
        streamed.push_str(&o.delta.text);
        if i < 3 {
            assert_eq!(o.delta.text.len(), 1, "plain text is released at once");
        }
        if (3..6).contains(&i) {
            assert_eq!(o.delta.text, "", "a possible stop prefix is held back");
        }
        if i == 6 {
            assert_eq!(o.finished, Some(FinishReason::Stop));
            break;
        }
    }
    assert_eq!(streamed, "abc");
    assert_eq!(em.text(), "abc");
    assert_eq!(
        em.tokens().len(),
        7,
        "tokens up to the one completing the stop are counted"
    );
}

#[test]
fn emit_block_is_cut_at_the_first_terminal_event() {
    let (_d, e) = engine(Family::Llama);
    let eos = e.eos_ids().to_vec();
    // Stop inside a block: the rest of the block is not committed.
    let toks = byte_tokens(&e, "xyEND123");
    let mut em = Emitter::new(e.tokenizer(), &eos, vec!["END".into()], false, 100);
    let o = em.emit_block(&toks, None);
    assert_eq!(o.committed, 5);
    assert_eq!(o.delta.text, "xy");
    assert_eq!(o.finished, Some(FinishReason::Stop));
    assert_eq!(em.emit_block(&toks, None).committed, 0, "nothing after a finish");
    // A held-back prefix that turns out not to be a stop is released.
    let mut em = Emitter::new(e.tokenizer(), &eos, vec!["ENDX".into()], false, 100);
    let o = em.emit_block(&byte_tokens(&e, "aEND"), None);
    assert_eq!(o.delta.text, "a");
    let o = em.emit_block(&byte_tokens(&e, "b"), None);
    assert_eq!(o.delta.text, "ENDb");
    // EOS inside a block: counted, no text, the rest dropped.
    let mut block = byte_tokens(&e, "hi");
    block.push(eos[0]);
    block.extend(byte_tokens(&e, "zz"));
    let mut em = Emitter::new(e.tokenizer(), &eos, vec![], false, 100);
    let o = em.emit_block(&block, None);
    assert_eq!(
        (o.committed, o.delta.text.as_str(), o.finished),
        (3, "hi", Some(FinishReason::Stop))
    );
    // max_tokens inside a block.
    let mut em = Emitter::new(e.tokenizer(), &eos, vec![], false, 4);
    let o = em.emit_block(&byte_tokens(&e, "abcdefg"), None);
    assert_eq!(
        (o.committed, o.delta.text.as_str(), o.finished),
        (4, "abcd", Some(FinishReason::Length))
    );
    // ignore_eos: EOS is an ordinary token.
    let mut em = Emitter::new(e.tokenizer(), &eos, vec![], true, 100);
    let o = em.emit_block(&block, None);
    assert_eq!(o.committed, block.len());
    assert_eq!(o.finished, None);
}

#[test]
fn emit_never_splits_a_utf8_character() {
    let (_d, e) = engine(Family::Llama);
    let eos = e.eos_ids().to_vec();
    let text = "é€😀";
    let toks = byte_tokens(&e, text);
    assert_eq!(toks.len(), 2 + 3 + 4);
    let mut em = Emitter::new(e.tokenizer(), &eos, vec![], false, 100);
    let mut pieces = Vec::new();
    for &t in &toks {
        let o = em.emit_block(&[t], None);
        if !o.delta.text.is_empty() {
            pieces.push(o.delta.text);
        }
    }
    assert_eq!(pieces, vec!["é", "€", "😀"]);
    // max_tokens cutting a character in half flushes what there is, lossily.
    let mut em = Emitter::new(e.tokenizer(), &eos, vec![], false, 1);
    let o = em.emit_block(&toks, None);
    assert_eq!(o.delta.text, "\u{FFFD}");
    assert_eq!(o.finished, Some(FinishReason::Length));
}

#[test]
fn a_client_gone_during_prefill_stops_it_between_chunks() {
    let dir = tmp();
    let path = dir.path().join("tiny.gguf");
    write_tiny_gguf(&path, &TinySpec::new(Family::Llama)).expect("write");
    let mut e = Engine::load(
        &path,
        "tiny",
        LoadOptions {
            prefill_chunk: 4,
            ..LoadOptions::default()
        },
    )
    .expect("load");
    let req = GenerateRequest {
        prompt_tokens: (0..40).map(|i| 97 + (i % 20)).collect(),
        sampling: SamplingParams::greedy(),
        max_tokens: Some(5),
        stop: vec![],
        logprobs: None,
        ignore_eos: true,
        spec: Default::default(),
    };
    let mut probes = 0;
    let out = e
        .generate(&req, &mut |d| {
            assert!(
                d.text.is_empty() && d.token_ids.is_empty(),
                "only liveness probes before output"
            );
            probes += 1;
            probes < 3
        })
        .expect("generate");
    assert_eq!(out.finish_reason, FinishReason::Cancelled);
    assert!(out.token_ids.is_empty());
    assert_eq!(probes, 3, "asked between chunks, stopped at the first 'gone'");
}
