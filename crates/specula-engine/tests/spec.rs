//! Exactness of speculative decoding: greedy output with speculation equals plain AR output in
//! text, token ids, logprobs, usage and finish reason, including the per-token cases where a
//! block is cut (stop strings at every position, EOS, max_tokens, context end), on tiny random
//! models (fast) and on SmolLM2 (the G-gate).

mod common;

use candle_core::quantized::GgmlDType;
use specula_engine::constraint::GrammarSpec;
use specula_engine::model::Family;
use specula_engine::speculative::{SampledVerify, SpecMode, SpecOptions};
use specula_engine::testing::{write_tiny_gguf, TinySpec};
use specula_engine::{ChatMessage, Engine, GenerateOutput, GenerateRequest, LoadOptions, SamplingParams};

/// n-gram speculation. Sampled requests verify by rejection sampling (the S-law tests below are
/// about it; coupling, the default, is tested byte for byte by the coupled tests, which set
/// [`SampledVerify::Coupled`] themselves).
fn spec(k: usize, adaptive: bool) -> SpecOptions {
    SpecOptions {
        mode: SpecMode::Ngram,
        draft_max: k,
        adaptive,
        sampled_verify: SampledVerify::Rejection,
    }
}

fn run(e: &mut Engine, req: &GenerateRequest) -> (GenerateOutput, String) {
    let mut streamed = String::new();
    let out = e
        .generate(req, &mut |d| {
            streamed.push_str(&d.text);
            true
        })
        .expect("generate");
    (out, streamed)
}

/// AR and speculative runs of `req` agree on everything a client sees; returns the spec run.
fn assert_same(e: &mut Engine, req: &GenerateRequest, opts: SpecOptions, what: &str) -> GenerateOutput {
    let mut ar_req = req.clone();
    ar_req.spec = SpecOptions::default();
    let ar = run(e, &ar_req);
    assert_same_as(e, &ar, req, opts, what)
}

/// As [`assert_same`], against an AR run made earlier.
fn assert_same_as(
    e: &mut Engine,
    (ar, ar_stream): &(GenerateOutput, String),
    req: &GenerateRequest,
    opts: SpecOptions,
    what: &str,
) -> GenerateOutput {
    let mut sp_req = req.clone();
    sp_req.spec = opts;
    let (sp, sp_stream) = run(e, &sp_req);
    assert_eq!(ar.text.as_bytes(), sp.text.as_bytes(), "{what}: text");
    assert_eq!(ar.token_ids, sp.token_ids, "{what}: token ids");
    assert_eq!(ar.finish_reason, sp.finish_reason, "{what}: finish_reason");
    assert_eq!(ar.stats.completion_tokens, sp.stats.completion_tokens, "{what}: usage");
    assert_eq!(ar.stats.prompt_tokens, sp.stats.prompt_tokens, "{what}: usage");
    assert_eq!(ar.logprobs, sp.logprobs, "{what}: logprobs");
    assert_eq!(ar_stream, &sp_stream, "{what}: streamed text");
    assert_eq!(sp_stream, sp.text, "{what}: stream equals final text");
    // The stats count only the accepted drafts that reached the output (a block cut at EOS, a
    // stop string or max_tokens drops the rest), and every target step commits its own token
    // unless the output ended inside its block.
    let s = &sp.stats.spec;
    assert!(
        s.accepted <= s.drafted && s.accepted <= s.committed,
        "{what}: stats {s:?}"
    );
    assert!(s.committed <= s.accepted + s.target_steps, "{what}: stats {s:?}");
    assert!(
        s.committed >= s.accepted + s.target_steps.saturating_sub(1),
        "{what}: stats {s:?}"
    );
    assert_eq!(
        s.accepted_by_position.iter().sum::<usize>(),
        s.accepted,
        "{what}: stats {s:?}"
    );
    sp
}

fn tiny(family: Family, dtype: GgmlDType, context: usize) -> (tempfile::TempDir, Engine) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    write_tiny_gguf(
        &path,
        &TinySpec {
            dtype,
            context,
            ..TinySpec::new(family)
        },
    )
    .expect("write");
    let e = Engine::load(&path, "tiny", LoadOptions::default()).expect("load");
    (dir, e)
}

fn greedy_req(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        prompt_tokens: prompt,
        sampling: SamplingParams::greedy(),
        max_tokens: Some(max_tokens),
        stop: vec![],
        logprobs: Some(2),
        ignore_eos: true,
        spec: SpecOptions::default(),
    }
}

#[test]
fn tiny_models_greedy_spec_equals_ar_for_every_k() {
    let mut accepted = 0;
    for (family, dtype) in [
        (Family::Llama, GgmlDType::Q4_1),
        (Family::Qwen2, GgmlDType::Q8_0),
        (Family::Qwen3, GgmlDType::Q5_0),
    ] {
        let (_d, mut e) = tiny(family, dtype, 256);
        let prompt = e.tokenize("the then the thin the then").expect("tokenize");
        let req = greedy_req(prompt, 120);
        for (k, adaptive) in [(1, false), (2, false), (4, false), (8, false), (8, true)] {
            let out = assert_same(&mut e, &req, spec(k, adaptive), &format!("{family:?} {dtype:?} k={k}"));
            assert_eq!(out.stats.spec.decode_path, "ngram");
            accepted += out.stats.spec.accepted;
        }
    }
    assert!(
        accepted > 0,
        "random models repeat themselves: some drafts must be accepted"
    );
}

#[test]
fn stop_string_at_every_position_of_a_block() {
    let (_d, mut e) = tiny(Family::Llama, GgmlDType::Q8_0, 256);
    let prompt = e.tokenize("in the thin then").expect("tokenize");
    let base = greedy_req(prompt, 80);
    let (ar, _) = run(&mut e, &base);
    let text = ar.text.clone();
    assert!(text.len() > 40, "need some text to cut");
    // A stop string starting at every character position of the first 40 bytes, lengths 1..3:
    // this puts the stop at every position of the accepted blocks, and across blocks.
    let mut cases = 0;
    for start in 0..40 {
        for len in 1..=3 {
            let Some(stop) = text.get(start..start + len) else {
                continue;
            };
            let mut req = base.clone();
            req.stop = vec![stop.to_string()];
            let out = assert_same(&mut e, &req, spec(4, false), &format!("stop {stop:?} at {start}"));
            assert!(out.text.len() <= start, "stop {stop:?}: text must end before it");
            cases += 1;
        }
    }
    assert!(cases >= 40, "only {cases} stop strings on character boundaries");
}

#[test]
fn eos_max_tokens_and_context_end_inside_blocks() {
    let (_d, mut e) = tiny(Family::Qwen2, GgmlDType::Q4_0, 96);
    let prompt = e.tokenize("the the the").expect("tokenize");
    // max_tokens ending at every offset.
    for mt in 1..30 {
        assert_same(
            &mut e,
            &greedy_req(prompt.clone(), mt),
            spec(4, false),
            &format!("max_tokens {mt}"),
        );
    }
    // The context ends while drafts are still proposed (draft longer than the room left).
    let mut req = greedy_req(prompt.clone(), 96 - prompt.len());
    req.max_tokens = None;
    let out = assert_same(&mut e, &req, spec(8, false), "context end");
    assert_eq!(out.finish_reason, specula_engine::FinishReason::Length);
    assert_eq!(prompt.len() + out.token_ids.len(), 96);
    // EOS inside a block: make the model's own frequent token the EOS by honouring EOS only
    // for a token it produces; the tiny model's EOS is <|im_end|>, which it rarely picks, so
    // check the ignore_eos = false path too.
    let mut req = greedy_req(prompt, 60);
    req.ignore_eos = false;
    assert_same(&mut e, &req, spec(4, false), "eos honoured");
}

#[test]
fn penalties_at_temperature_zero() {
    let (_d, mut e) = tiny(Family::Qwen3, GgmlDType::Q8_0, 256);
    let prompt = e.tokenize("then the thin then the").expect("tokenize");
    let mut req = greedy_req(prompt, 100);
    req.sampling.repetition_penalty = 1.3;
    req.sampling.presence_penalty = 0.4;
    req.sampling.frequency_penalty = 0.2;
    for k in [1, 3, 8] {
        assert_same(&mut e, &req, spec(k, false), &format!("penalties k={k}"));
    }
}

/// OpenAI's `logit_bias` moves greedy output (a banned token never appears, a favoured one
/// takes over) and speculation commits the same bytes: n-gram lookup does not see the bias
/// (drafts are only proposals), so its drafts of a banned token are rejected like any other;
/// the draft model adds it to its rows (`speculative::DraftSampling`). Without logprobs a greedy request takes the argmax-only
/// path (`Sequence::argmax_suffices`), which must see the bias too.
#[test]
fn logit_bias_at_temperature_zero() {
    let (_d, mut e) = tiny_pair(Draft::Same);
    let prompt = e.tokenize("then the thin then the").expect("tokenize");
    let req = greedy_req(prompt, 60);
    let (plain, _) = run(&mut e, &req);
    // Ban the most frequent output token, favour one the output never has.
    let mut counts = std::collections::HashMap::new();
    for &t in &plain.token_ids {
        *counts.entry(t).or_insert(0) += 1;
    }
    let (&banned, _) = counts
        .iter()
        .max_by_key(|&(t, c)| (*c, std::cmp::Reverse(*t)))
        .expect("tokens");
    let favoured = (0..256u32).find(|t| !counts.contains_key(t)).expect("an unused token");
    let mut biased = req.clone();
    biased.sampling = biased
        .sampling
        .with_logit_bias(vec![(favoured, 4.0), (banned, -100.0)])
        .expect("bias");
    let (ar, _) = run(&mut e, &biased);
    assert!(!ar.token_ids.contains(&banned), "{:?}", ar.token_ids);
    assert_ne!(ar.token_ids, plain.token_ids);
    for k in [1, 3, 8] {
        assert_same(&mut e, &biased, spec(k, false), &format!("logit_bias ngram k={k}"));
        let draft = SpecOptions {
            mode: SpecMode::Draft,
            draft_max: k,
            adaptive: false,
            sampled_verify: Default::default(),
        };
        assert_same(&mut e, &biased, draft, &format!("logit_bias draft k={k}"));
    }
    let mut bare = biased.clone();
    bare.logprobs = None;
    for opts in [SpecOptions::default(), spec(4, false)] {
        let mut r = bare.clone();
        r.spec = opts;
        let (out, _) = run(&mut e, &r);
        assert_eq!(out.token_ids, ar.token_ids, "without logprobs, {opts:?}");
    }
    // With penalties too (bias first, then the penalties, in both paths).
    biased.sampling.repetition_penalty = 1.3;
    biased.sampling.frequency_penalty = 0.2;
    assert_same(&mut e, &biased, spec(4, true), "logit_bias with penalties");
    // A token past the vocabulary, or a bias out of range, is the request's error.
    for bias in [vec![(1 << 20, 1.0)], vec![(5, 101.0)]] {
        let mut bad = req.clone();
        bad.sampling.logit_bias = bias;
        let err = e.generate(&bad, &mut |_| true).expect_err("invalid");
        assert!(err.to_string().contains("logit_bias"), "{err}");
    }
}

#[test]
fn non_invariant_models_fall_back_to_ar_and_say_so() {
    let (_d, mut e) = tiny(Family::Llama, GgmlDType::F16, 256);
    let prompt = e.tokenize("the then").expect("tokenize");
    let mut req = greedy_req(prompt, 10);
    req.spec = spec(4, true);
    let (out, _) = run(&mut e, &req);
    assert!(out
        .stats
        .spec
        .decode_path
        .starts_with("ar (this model's kernels are not batch-invariant"));
    assert_eq!(out.stats.spec.drafted, 0);
}

fn write_tiny(dir: &std::path::Path, name: &str, spec: TinySpec) -> std::path::PathBuf {
    let path = dir.join(name);
    write_tiny_gguf(&path, &spec).expect("write");
    path
}

/// Which draft model a tiny target gets.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Draft {
    /// The target's own file: every draft is accepted.
    Same,
    /// The target's weights quantized to Q4_0: close to the target, most drafts accepted.
    Requantized,
    /// Other random weights, one layer: most drafts rejected.
    Other,
}

/// A tiny Q8_0 target with a draft model attached.
fn tiny_pair(draft: Draft) -> (tempfile::TempDir, Engine) {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = TinySpec {
        dtype: GgmlDType::Q8_0,
        ..TinySpec::new(Family::Qwen2)
    };
    let target = write_tiny(dir.path(), "target.gguf", base.clone());
    let draft_spec = match draft {
        Draft::Same => base,
        Draft::Requantized => TinySpec {
            dtype: GgmlDType::Q4_0,
            ..base
        },
        Draft::Other => TinySpec {
            seed: 7,
            layers: 1,
            dtype: GgmlDType::Q4_0,
            ..base
        },
    };
    let draft = write_tiny(dir.path(), "draft.gguf", draft_spec);
    let mut e = Engine::load(&target, "tiny", LoadOptions::default()).expect("load");
    e.attach_draft_model(&draft, "tiny-draft").expect("attach");
    (dir, e)
}

/// A draft model is checked against the target from its headers, before any weight is read:
/// one with another tokenizer is refused there, and a load cancelled by then (its client went
/// away) stops there. Runs off the engine (`Engine::draft_loader`), attached by a move.
#[test]
fn draft_loads_are_checked_before_the_weights() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec {
        dtype: GgmlDType::Q8_0,
        ..TinySpec::new(Family::Qwen2)
    };
    let target = write_tiny(dir.path(), "target.gguf", spec.clone());
    let draft = write_tiny(dir.path(), "draft.gguf", TinySpec { seed: 7, ..spec });
    let mut e = Engine::load(&target, "tiny", LoadOptions::default()).expect("load");
    let loader = e.draft_loader();
    let yes = std::sync::atomic::AtomicBool::new(true);
    let no = std::sync::atomic::AtomicBool::new(false);
    let err = loader.load(&draft, "d", &yes).err().expect("a cancelled load fails");
    assert!(format!("{err:#}").contains("cancelled"), "{err:#}");
    let other =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3moe-tiny/model-q8_0.gguf");
    let err = loader
        .load(&other, "other", &no)
        .err()
        .expect("another tokenizer is refused");
    assert!(format!("{err:#}").contains("cannot draft for tiny"), "{err:#}");
    let d = loader.load(&draft, "d", &no).expect("a matching draft model loads");
    assert_eq!(d.id(), "d");
    e.attach_loaded_draft(d);
    assert_eq!(e.draft_model_id(), Some("d"));
}

/// As [`spec`], with drafter `mode`.
fn mode(mode: SpecMode, k: usize, adaptive: bool) -> SpecOptions {
    SpecOptions {
        mode,
        draft_max: k,
        adaptive,
        sampled_verify: SampledVerify::Rejection,
    }
}

/// As [`mode`], verifying sampled drafts by coupling.
fn coupled(m: SpecMode, k: usize, adaptive: bool) -> SpecOptions {
    SpecOptions {
        sampled_verify: SampledVerify::Coupled,
        ..mode(m, k, adaptive)
    }
}

/// Drafter-invariant sampling ([`SampledVerify::Coupled`]): a seeded sampled request's output
/// with speculation is byte-identical to plain decoding with the same seed (text, token ids,
/// logprobs, usage, finish reason, stream), for a draft model that agrees with the target often
/// and one that mostly does not, n-gram lookup, fixed and adaptive k, with top-k, top-p, a logit
/// bias and penalties; coupling is the default. Rejection sampling with the same seeds
/// gives other samples (same law, `sampling_spec_matches_ar_in_distribution_on_tiny_models`):
/// without the coupling this test fails.
#[test]
fn seeded_sampling_with_speculation_is_plain_decoding() {
    for which in [Draft::Requantized, Draft::Other] {
        let (_d, mut e) = tiny_pair(which);
        let prompt = e.tokenize("the then the thin then the").expect("tokenize");
        let mut req = sampled_req(prompt, 40);
        req.logprobs = Some(2);
        req.sampling.top_k = 40;
        let (mut drafted, mut accepted, mut differ) = (0, 0, 0);
        for seed in 0..24u64 {
            let mut r = req.clone();
            r.sampling.seed = Some(seed);
            match seed % 4 {
                1 => r.sampling.top_p = 0.9,
                2 => r.sampling.repetition_penalty = 1.2,
                3 => {
                    r.sampling = r
                        .sampling
                        .clone()
                        .with_logit_bias(vec![(5, -100.0), (9, 2.0)])
                        .expect("bias");
                    r.sampling.frequency_penalty = 0.5;
                }
                _ => {}
            }
            let mut ar_req = r.clone();
            ar_req.spec = SpecOptions::default();
            let ar = run(&mut e, &ar_req);
            for opts in [
                coupled(SpecMode::Draft, 3, false),
                coupled(SpecMode::Draft, 8, true),
                coupled(SpecMode::On, 4, true),
                coupled(SpecMode::Ngram, 4, false),
                SpecOptions {
                    mode: SpecMode::Draft,
                    draft_max: 2,
                    ..SpecOptions::default()
                },
            ] {
                let sp = assert_same_as(&mut e, &ar, &r, opts, &format!("{which:?} seed {seed} {opts:?}"));
                assert_eq!(sp.stats.spec.verify, "coupled");
                drafted += sp.stats.spec.drafted;
                accepted += sp.stats.spec.accepted;
            }
            // Rejection sampling: same law, other samples.
            let mut rej = r.clone();
            rej.spec = mode(SpecMode::Draft, 3, false);
            let (out, _) = run(&mut e, &rej);
            assert_eq!(out.stats.spec.verify, "rejection");
            differ += usize::from(out.token_ids != ar.0.token_ids);
        }
        eprintln!("{which:?}: drafted {drafted} accepted {accepted}; rejection differed on {differ} of 24 seeds");
        // The draft model draws with the target's key: its drafts are accepted about as often as
        // rejection sampling accepts its own (at least (1 - TV)/(1 + TV) a token against 1 - TV);
        // drafts drawn independently of the target's draws would be accepted far less.
        let mut acceptance = |opts: SpecOptions| {
            let (mut d, mut a) = (0, 0);
            for seed in 0..40u64 {
                let mut r = req.clone();
                r.sampling.seed = Some(seed);
                r.spec = opts;
                let (out, _) = run(&mut e, &r);
                d += out.stats.spec.drafted;
                a += out.stats.spec.accepted;
            }
            a as f64 / d.max(1) as f64
        };
        let (c, rj) = (
            acceptance(coupled(SpecMode::Draft, 3, false)),
            acceptance(mode(SpecMode::Draft, 3, false)),
        );
        eprintln!("{which:?}: draft-model acceptance coupled {c:.3}, rejection {rj:.3}");
        if which == Draft::Requantized {
            // 0.36 against 0.46 (bound 0.30); drafts drawn apart from the target's key: 0.07.
            assert!(
                c > 0.9 * rj / (2.0 - rj),
                "coupled acceptance {c:.3} below (1 - TV)/(1 + TV) with 1 - TV = {rj:.3}"
            );
        }
        assert!(
            accepted > 0 && accepted < drafted,
            "{which:?}: accepts and rejects both happen"
        );
        assert!(differ > 0, "{which:?}: rejection sampling's samples are not AR's");
    }
}

/// Prompts of the batch tests: a tiny model's text that repeats, so drafts are accepted.
const BATCH_PROMPTS: [&str; 3] = [
    "the then the thin the then",
    "a b a b a b a",
    "thin then thin then thin",
];

/// Runs `reqs` as one batch, trimming every pending draft to another length at every step
/// (`Sequence::trim_draft`, as the batch's draft budget may), and checks that each stream's
/// tokens equal its solo plain run and that a draft is trimmable exactly when its k is adaptive;
/// returns the outputs.
fn batch_with_trims(e: &mut Engine, reqs: &[GenerateRequest]) -> Vec<GenerateOutput> {
    let solo: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| {
            let mut ar = r.clone();
            ar.spec = SpecOptions::default();
            run(e, &ar).0.token_ids
        })
        .collect();
    let mut seqs: Vec<_> = reqs.iter().map(|r| e.start_sequence(r, None).expect("start")).collect();
    let mut step = 0;
    while seqs.iter().any(|s| s.finished().is_none()) {
        for (i, s) in seqs.iter_mut().enumerate() {
            if let Some(d) = s.pending_draft() {
                assert!(d.len > 0 && d.alphas.len() == d.len && d.alphas.iter().all(|a| (0.0..=1.0).contains(a)));
                assert_eq!(d.trimmable, reqs[i].spec.adaptive);
                s.trim_draft((step + i) % (d.len + 1));
            }
        }
        let mut refs: Vec<_> = seqs.iter_mut().collect();
        for r in e.step(&mut refs) {
            r.expect("step");
        }
        step += 1;
        assert!(step < 500, "no progress");
    }
    seqs.into_iter()
        .enumerate()
        .map(|(i, s)| {
            let out = e.retire(s, true);
            assert_eq!(out.token_ids, solo[i], "stream {i} ({:?})", reqs[i].spec);
            out
        })
        .collect()
}

/// Coupled drafts in a batch: the budget may trim them (they are deterministic drafts), and each
/// seeded sampled stream still equals its solo plain run, whatever it kept.
#[test]
fn seeded_sampled_streams_in_a_batch_equal_their_solo_runs() {
    let (_d, mut e) = tiny_pair(Draft::Other);
    let prompts = BATCH_PROMPTS;
    let modes = [
        coupled(SpecMode::Draft, 4, true),
        coupled(SpecMode::Draft, 3, false),
        coupled(SpecMode::Ngram, 8, true),
    ];
    let mut reqs = Vec::new();
    for (i, m) in modes.iter().enumerate() {
        let mut r = sampled_req(e.tokenize(prompts[i]).expect("tokenize"), 50);
        r.sampling.seed = Some(100 + i as u64);
        r.sampling.top_k = 20;
        r.spec = *m;
        reqs.push(r);
    }
    for out in batch_with_trims(&mut e, &reqs) {
        assert_eq!(out.stats.spec.verify, "coupled");
    }
}

#[test]
fn draft_model_greedy_equals_ar_for_every_k() {
    for which in [Draft::Same, Draft::Other] {
        let same = which == Draft::Same;
        let (_d, mut e) = tiny_pair(which);
        let prompt = e.tokenize("the then the thin").expect("tokenize");
        let mut req = greedy_req(prompt, 90);
        req.sampling.repetition_penalty = if same { 1.0 } else { 1.1 };
        let (mut drafted, mut accepted) = (0, 0);
        for (k, adaptive) in [(1, false), (2, false), (4, false), (8, false), (8, true)] {
            for m in [SpecMode::Draft, SpecMode::Default, SpecMode::On] {
                let out = assert_same(&mut e, &req, mode(m, k, adaptive), &format!("{which:?} {m:?} k={k}"));
                // `default` and `on` run n-gram lookup beside the draft model, with adaptive k.
                let path = if m != SpecMode::Draft && adaptive {
                    "draft-model:tiny-draft+ngram"
                } else {
                    "draft-model:tiny-draft"
                };
                assert_eq!(out.stats.spec.decode_path, path);
                // The draft model's own drafts (the lookup's may be rejected).
                drafted += out.stats.spec.drafted - out.stats.spec.lookup_drafted;
                accepted += out.stats.spec.accepted - out.stats.spec.lookup_accepted;
            }
        }
        if same {
            assert_eq!(accepted, drafted, "a model drafting for itself is always accepted");
        } else {
            assert!(accepted < drafted, "other weights disagree sometimes");
        }
        assert!(drafted > 0);
    }
}

/// The batch's draft budget may verify only part of a draft (`Sequence::trim_draft`). Whatever
/// it keeps, each stream of a batch equals its solo AR run: n-gram and a draft model whose
/// weights disagree (its cache rolls back past the trimmed tokens), adaptive and fixed k,
/// trimmed to another length at every step.
#[test]
fn trimmed_drafts_in_a_batch_still_equal_ar() {
    let (_d, mut e) = tiny_pair(Draft::Other);
    let prompts = BATCH_PROMPTS;
    let modes = [
        mode(SpecMode::Ngram, 4, true),
        mode(SpecMode::Draft, 4, false),
        mode(SpecMode::Draft, 2, false),
        mode(SpecMode::Ngram, 8, false),
    ];
    let mut reqs = Vec::new();
    for (i, m) in modes.iter().enumerate() {
        let mut r = greedy_req(e.tokenize(prompts[i % prompts.len()]).expect("tokenize"), 60);
        r.spec = *m;
        reqs.push(r);
    }
    for (i, out) in batch_with_trims(&mut e, &reqs).into_iter().enumerate() {
        let sp = &out.stats.spec;
        // A fixed-k stream verifies what is left after every trim; an adaptive one may also
        // pause drafting when its timings (noisy on a loaded machine) say drafts do not pay.
        let verified = sp.drafted > 0 || reqs[i].spec.adaptive;
        assert!(
            verified && sp.trimmed > 0,
            "stream {i}: drafted {} trimmed {}",
            sp.drafted,
            sp.trimmed
        );
        assert_eq!(
            sp.drafted_by_position.iter().sum::<usize>(),
            sp.drafted,
            "stream {i}: only verified drafts count by position"
        );
    }
}

/// The step's prompt-row budget goes to the prompt with the fewest tokens left first: a short
/// prompt that arrives while a long one is being prefilled gets its first token at the next
/// step, the long one takes the rows it left (chunks that end at other places), and every
/// output equals its solo run (greedy and seeded sampled, with and without speculation).
#[test]
fn a_short_prompt_is_not_kept_behind_a_long_prefill() {
    let (_d, mut e) = tiny(Family::Llama, GgmlDType::Q4_1, 4096);
    let long_text = "the then the thin then the ".repeat(150);
    let long = e.tokenize(&long_text).expect("tokenize");
    assert!(long.len() > 1500 && long.len() < 4000, "{} tokens", long.len());
    let short = e.tokenize("a b a b").expect("tokenize");
    let mut reqs = [greedy_req(long, 8), greedy_req(short.clone(), 8), sampled_req(short, 8)];
    reqs[0].spec = spec(4, true);
    reqs[2].sampling.seed = Some(5);
    reqs[2].spec = spec(4, false);
    let solo: Vec<Vec<u32>> = reqs.iter().map(|r| run(&mut e, r).0.token_ids).collect();
    let mut seqs = vec![e.start_sequence(&reqs[0], None).expect("start")];
    {
        let mut refs: Vec<_> = seqs.iter_mut().collect();
        for r in e.step(&mut refs) {
            r.expect("step");
        }
    }
    assert_eq!(seqs[0].prefill_remaining(), reqs[0].prompt_tokens.len() - 512);
    seqs.push(e.start_sequence(&reqs[1], None).expect("start"));
    seqs.push(e.start_sequence(&reqs[2], None).expect("start"));
    let mut first_token_step = [None; 3];
    let mut step = 0;
    while seqs.iter().any(|s| s.finished().is_none()) {
        let before = seqs[0].prefill_remaining();
        let mut refs: Vec<_> = seqs.iter_mut().collect();
        let outs = e.step(&mut refs);
        for (i, r) in outs.into_iter().enumerate() {
            let out = r.expect("step");
            if out.is_some_and(|o| !o.delta.token_ids.is_empty()) && first_token_step[i].is_none() {
                first_token_step[i] = Some(step);
            }
        }
        if step == 0 {
            // The two short prompts ran whole; the long one took the rest of the budget.
            let short_rows = 2 * reqs[1].prompt_tokens.len();
            assert_eq!(before - seqs[0].prefill_remaining(), 512 - short_rows);
        }
        step += 1;
        assert!(step < 100, "no progress");
    }
    assert_eq!(
        first_token_step[1],
        Some(0),
        "the short prompt's first token comes at once"
    );
    assert_eq!(first_token_step[2], Some(0));
    assert!(first_token_step[0] > Some(0));
    for (i, s) in seqs.into_iter().enumerate() {
        assert_eq!(e.retire(s, true).token_ids, solo[i], "request {i}");
    }
}

#[test]
fn draft_mode_needs_a_draft_model_and_default_falls_back_to_ngram() {
    let dir = tempfile::tempdir().expect("tempdir");
    let target = write_tiny(
        dir.path(),
        "t.gguf",
        TinySpec {
            dtype: GgmlDType::Q8_0,
            ..TinySpec::new(Family::Qwen2)
        },
    );
    // `draft` mode without a draft model is a request error, not a silent fallback.
    let mut plain = Engine::load(&target, "tiny", LoadOptions::default()).expect("load");
    let mut req = greedy_req(plain.tokenize("the").expect("tokenize"), 4);
    req.spec = mode(SpecMode::Draft, 4, true);
    let err = plain.generate(&req, &mut |_| true).expect_err("no draft model");
    assert!(err.to_string().contains("needs a draft model"), "{err}");
    // `default` without a draft model uses n-gram lookup.
    req.spec = mode(SpecMode::Default, 4, true);
    let (out, _) = run(&mut plain, &req);
    assert_eq!(out.stats.spec.decode_path, "ngram");
}

/// Two-sample chi-square homogeneity test on the first `n` generated tokens: categories with
/// fewer than 10 samples in total are merged. Returns (statistic, degrees of freedom, z) where z
/// is the Wilson-Hilferty normal approximation of the upper tail.
fn chi_square(a: &[Vec<u32>], b: &[Vec<u32>]) -> (f64, usize, f64) {
    use std::collections::BTreeMap;
    let mut counts: BTreeMap<&[u32], (f64, f64)> = BTreeMap::new();
    for s in a {
        counts.entry(s).or_default().0 += 1.0;
    }
    for s in b {
        counts.entry(s).or_default().1 += 1.0;
    }
    let mut cats: Vec<(f64, f64)> = Vec::new();
    let mut other = (0.0, 0.0);
    for (_, c) in counts {
        if c.0 + c.1 < 10.0 {
            other.0 += c.0;
            other.1 += c.1;
        } else {
            cats.push(c);
        }
    }
    if other.0 + other.1 > 0.0 {
        cats.push(other);
    }
    let (na, nb) = (a.len() as f64, b.len() as f64);
    let mut stat = 0.0;
    for (ca, cb) in &cats {
        let tot = ca + cb;
        let (ea, eb) = (tot * na / (na + nb), tot * nb / (na + nb));
        stat += (ca - ea).powi(2) / ea + (cb - eb).powi(2) / eb;
    }
    let df = cats.len().saturating_sub(1).max(1);
    let k = df as f64;
    let z = ((stat / k).cbrt() - (1.0 - 2.0 / (9.0 * k))) / (2.0 / (9.0 * k)).sqrt();
    (stat, df, z)
}

/// First `n` tokens of `runs` seeded samples of `req` under `opts`.
/// `runs` sampled outputs of `req` under `opts` (seeds 0..runs), with the draft tokens drafted
/// and accepted over all of them, and of those drafted, how many by n-gram lookup beside a
/// model drafter.
fn samples(
    e: &mut Engine,
    req: &GenerateRequest,
    opts: SpecOptions,
    runs: u64,
) -> (Vec<Vec<u32>>, usize, usize, usize) {
    samples_constrained(e, req, opts, runs, None)
}

/// As [`samples`], each run constrained by `grammar` (structured output) when given.
fn samples_constrained(
    e: &mut Engine,
    req: &GenerateRequest,
    opts: SpecOptions,
    runs: u64,
    grammar: Option<&GrammarSpec>,
) -> (Vec<Vec<u32>>, usize, usize, usize) {
    let (mut drafted, mut accepted, mut lookup) = (0, 0, 0);
    // Speculative runs take other seeds than plain ones: a seed's plain draws are keyed by
    // position, so the same seeds would pair the two samples (the first token, and every step
    // without a draft, the same in both), which a two-sample test must not have.
    let first = if opts.mode == SpecMode::Off { 0 } else { 1_000_000 };
    let out = (first..first + runs)
        .map(|seed| {
            let mut r = req.clone();
            r.spec = opts;
            r.sampling.seed = Some(seed);
            let o = e.generate_constrained(&r, grammar, &mut |_| true).expect("generate");
            drafted += o.stats.spec.drafted;
            accepted += o.stats.spec.accepted;
            lookup += o.stats.spec.lookup_drafted;
            o.token_ids
        })
        .collect();
    (out, drafted, accepted, lookup)
}

fn sampled_req(prompt: Vec<u32>, n: usize) -> GenerateRequest {
    let mut req = greedy_req(prompt, n);
    req.logprobs = None;
    req.sampling = SamplingParams {
        temperature: 0.8,
        ..SamplingParams::default()
    };
    req
}

/// Tokens `range` of every sample.
fn window(samples: &[Vec<u32>], range: std::ops::Range<usize>) -> Vec<Vec<u32>> {
    samples.iter().map(|s| s[range.clone()].to_vec()).collect()
}

/// S-law on a Mixture-of-Experts target (a tiny Qwen3-MoE in Q8_0: top-2 of 8 experts on three
/// of its four layers) with a dense one-layer draft model of other random weights: the law of
/// tokens 0..3 and 1..4 equals AR's (chi-square, z < 3.09, 3000 seeded runs each).
#[test]
fn sampling_spec_matches_ar_in_distribution_on_an_moe_target() {
    use specula_engine::arch::qwen_moe::QwenMoe;
    use specula_engine::testing::{tiny_moe_config, write_random_gguf};
    let dir = tempfile::tempdir().expect("tempdir");
    let target = dir.path().join("moe.gguf");
    let c = tiny_moe_config("qwen3moe");
    write_random_gguf(&target, &QwenMoe, "qwen3moe", &c, GgmlDType::Q8_0, 11).expect("write");
    let draft = write_tiny(
        dir.path(),
        "draft.gguf",
        TinySpec {
            seed: 7,
            layers: 1,
            dtype: GgmlDType::Q4_0,
            ..TinySpec::new(Family::Qwen3)
        },
    );
    let mut e = Engine::load(&target, "tiny-moe", LoadOptions::default()).expect("load");
    assert!(e.model().batch_invariant());
    e.attach_draft_model(&draft, "tiny-draft").expect("attach");
    let prompt = e.tokenize("the then the thin then the").expect("tokenize");
    let mut req = sampled_req(prompt, 4);
    req.sampling.top_k = 40;
    let runs = 3000;
    let (ar, ..) = samples(&mut e, &req, SpecOptions::default(), runs);
    let (sp, drafted, accepted, _) = samples(&mut e, &req, mode(SpecMode::Draft, 3, false), runs);
    assert!(drafted >= runs as usize, "speculation ran ({drafted} drafted)");
    assert!(accepted > 0 && accepted < drafted, "accepts and rejects both happen");
    for w in [0..3, 1..4] {
        let (stat, df, z) = chi_square(&window(&ar, w.clone()), &window(&sp, w.clone()));
        eprintln!("moe tokens {w:?}: chi2 {stat:.1} df {df} z {z:.2}; drafted {drafted} accepted {accepted}");
        assert!(
            z < 3.09,
            "law of tokens {w:?} differs from AR (chi2 {stat:.1}, df {df}, z {z:.2})"
        );
    }
}

/// S-law on tiny models: with a sampling draft model (q close to p: most drafts accepted, full
/// accepts and bonus tokens; q far from p: most rejected, residual draws), the law of the first
/// three tokens, and of tokens 2..4 (one verify block of 2 drafts + the bonus or correction),
/// equals AR's by a chi-square test at p < 0.001 (z > 3.09). Runs are seeded: deterministic.
#[test]
fn sampling_spec_matches_ar_in_distribution_on_tiny_models() {
    for which in [Draft::Requantized, Draft::Other] {
        let (_d, mut e) = tiny_pair(which);
        let prompt = e.tokenize("the then the thin then the").expect("tokenize");
        let mut req = sampled_req(prompt, 4);
        req.sampling.top_k = 40;
        let runs = 3000;
        let (ar, ..) = samples(&mut e, &req, SpecOptions::default(), runs);
        let m = SpecMode::Draft;
        let (sp, drafted, accepted, _) = samples(&mut e, &req, mode(m, 3, false), runs);
        assert!(
            drafted >= runs as usize,
            "{which:?}: speculation ran ({drafted} drafted)"
        );
        assert!(
            accepted > 0 && accepted < drafted,
            "{which:?}: accepts and rejects both happen"
        );
        for w in [0..3, 1..4] {
            let (stat, df, z) = chi_square(&window(&ar, w.clone()), &window(&sp, w.clone()));
            eprintln!("{which:?} tokens {w:?}: chi2 {stat:.1} df {df} z {z:.2}; drafted {drafted} accepted {accepted}");
            assert!(
                z < 3.09,
                "{which:?}: law of tokens {w:?} differs from AR (chi2 {stat:.1}, df {df}, z {z:.2})"
            );
        }
        // And the test can fail: a different temperature is a different law.
        let mut hot = req.clone();
        hot.sampling.temperature = 1.2;
        let (other, ..) = samples(&mut e, &hot, SpecOptions::default(), runs);
        let (stat, df, z) = chi_square(&window(&ar, 0..3), &window(&other, 0..3));
        assert!(
            z > 3.09,
            "temperature 0.8 vs 1.2 must be told apart (chi2 {stat:.1}, df {df}, z {z:.2})"
        );
        // With a logit bias: the draft model draws from its biased rows and q must be that
        // distribution (`speculative::DraftSampling`), or the law moves. The bias moves AR's law.
        // AR's two most frequent first tokens: the first is banned, the second favoured.
        let mut counts = std::collections::BTreeMap::<u32, usize>::new();
        for o in &ar {
            *counts.entry(o[0]).or_default() += 1;
        }
        let mut by_count: Vec<(usize, u32)> = counts.into_iter().map(|(t, c)| (c, t)).collect();
        by_count.sort_unstable_by(|a, b| b.cmp(a));
        assert!(by_count.len() >= 2, "{which:?}: AR's first tokens vary ({by_count:?})");
        let mut biased = req.clone();
        biased.sampling = biased
            .sampling
            .clone()
            .with_logit_bias(vec![(by_count[0].1, -100.0), (by_count[1].1, 4.0)])
            .expect("bias");
        let (ar_b, ..) = samples(&mut e, &biased, SpecOptions::default(), runs);
        let (sp_b, drafted, accepted, _) = samples(&mut e, &biased, mode(m, 3, false), runs);
        assert!(accepted > 0 && accepted < drafted, "{which:?} biased");
        let (stat, df, z) = chi_square(&window(&ar_b, 0..3), &window(&sp_b, 0..3));
        eprintln!("{which:?} biased: chi2 {stat:.1} df {df} z {z:.2}; drafted {drafted} accepted {accepted}");
        assert!(
            z < 3.09,
            "{which:?}: with a logit bias the law differs from AR (chi2 {stat:.1}, df {df}, z {z:.2})"
        );
        let (stat, df, z) = chi_square(&window(&ar, 0..3), &window(&ar_b, 0..3));
        assert!(
            z > 3.09,
            "the bias must move the law (chi2 {stat:.1}, df {df}, z {z:.2})"
        );
    }
}

/// Sampled drafts under a grammar (a regex that forbids the target's favourite first token, 'V';
/// top-k 3, so a draft model's unmasked rows often draw it):
/// - Model drafters mask their rows with the grammar state after the drafts before them
///   (`Constraint::mask_after`): a draft model equal to the target then draws from exactly p,
///   and every draft is accepted. Unmasked (`SPECULA_DRAFT_MASK=0`), its drafts of 'V' are
///   verified and rejected.
/// - S-law: masked or not, the law of tokens 0..3 and 1..4 equals AR's (chi-square, z < 3.09,
///   3000 seeded runs, a draft model close to the target). Unmasked, a drawn forbidden token must
///   be verified (p = 0: rejected, the position drawn from the residual max(0, p - q)), not cut
///   before verification: the cut depends on the drawn token, and drawing that position from p
///   instead moves the law. Cutting sampled drafts there, as Specula did before, fails this
///   test (first at the draft = target case; the law alone at z 6.3). (Token 0 comes from the
///   prefill, before any draft.)
///
/// One test, because the switch is a process-wide environment variable (read per request, and
/// only requests with a constraint are affected).
#[test]
fn sampled_drafts_under_a_grammar() {
    let mask_off = |off: bool| {
        if off {
            std::env::set_var("SPECULA_DRAFT_MASK", "0");
        } else {
            std::env::remove_var("SPECULA_DRAFT_MASK");
        }
    };
    let g = GrammarSpec::Regex("[^V]*".into());
    let runs = 3000;

    let (_d, mut same) = tiny_pair(Draft::Same);
    let prompt = same.tokenize("the then the thin then the").expect("tokenize");
    let mut req = sampled_req(prompt, 4);
    req.sampling.top_k = 3;
    for off in [false, true] {
        mask_off(off);
        let (_, drafted, accepted, _) =
            samples_constrained(&mut same, &req, mode(SpecMode::Draft, 3, false), 200, Some(&g));
        mask_off(false);
        eprintln!("draft = target, mask off {off}: drafted {drafted} accepted {accepted}");
        assert!(drafted >= 200, "drafts were verified ({drafted})");
        if off {
            assert!(
                accepted < drafted,
                "unmasked drafts of 'V' are rejected ({accepted} of {drafted})"
            );
        } else {
            assert_eq!(accepted, drafted, "masked, the draft model draws from p itself");
        }
    }

    let (_d, mut e) = tiny_pair(Draft::Requantized);
    let (ar, ..) = samples_constrained(&mut e, &req, SpecOptions::default(), runs, Some(&g));
    for off in [false, true] {
        mask_off(off);
        let (sp, drafted, accepted, _) =
            samples_constrained(&mut e, &req, mode(SpecMode::Draft, 3, false), runs, Some(&g));
        mask_off(false);
        assert!(
            accepted > 0 && accepted < drafted,
            "accepts and rejects both happen ({accepted} of {drafted})"
        );
        for w in [0..3, 1..4] {
            let (stat, df, z) = chi_square(&window(&ar, w.clone()), &window(&sp, w.clone()));
            eprintln!("grammar, mask off {off}, tokens {w:?}: chi2 {stat:.1} df {df} z {z:.2}; drafted {drafted} accepted {accepted}");
            assert!(
                z < 3.09,
                "mask off {off}: under a grammar the law of tokens {w:?} differs from AR (chi2 {stat:.1}, df {df}, z {z:.2})"
            );
        }
    }
    // The grammar bites: without it 'V' is the most frequent first token; with it, never drawn.
    let (free, ..) = samples(&mut e, &req, SpecOptions::default(), 300);
    let v = e.tokenize("V").expect("tokenize");
    let firsts = |s: &[Vec<u32>]| s.iter().filter(|o| o[..1] == v[..]).count();
    assert!(firsts(&free) > 60, "'V' first in {} of 300 free runs", firsts(&free));
    assert_eq!(firsts(&ar), 0, "the grammar forbids 'V'");
}

/// The chi-square test on a real model (SmolLM2, temperature 0.8, n-gram lookup on a prompt
/// that repeats, so drafts start at the first decode step; then `on` with the trained MTP head
/// and the lookup beside it).
#[test]
fn smollm2_sampling_spec_matches_ar_in_distribution() {
    let path = common::model_path("smollm2-135m-instruct");
    let mut e = Engine::load(&path, "smollm2", LoadOptions::default()).expect("load");
    let prompt = e
        .tokenize("red green blue, red green blue, red green blue, red green")
        .expect("tokenize");
    let req = sampled_req(prompt, 3);
    let runs = 300;
    let (ar, ..) = samples(&mut e, &req, SpecOptions::default(), runs);
    let (sp, drafted, accepted, _) = samples(&mut e, &req, spec(3, false), runs);
    let (stat, df, z) = chi_square(&ar, &sp);
    eprintln!("smollm2 chi2 {stat:.1} df {df} z {z:.2}; drafted {drafted} accepted {accepted}");
    assert!(accepted > 0 && drafted > accepted);
    assert!(
        z < 3.09,
        "first-3-token law differs from AR (chi2 {stat:.1}, df {df}, z {z:.2})"
    );
    // `on` with the trained MTP head: the head's sampled drafts (q its distribution) and the
    // lookup's deterministic ones, the drafter chosen per step by the adaptive controller (the
    // lookup wins steps once its match classes have a record, so 10 tokens per run, and the
    // law compared on tokens 0..3 and 5..8).
    e.attach_mtp_head(&common::head_path("smollm2-135m-instruct", "mtp"))
        .expect("attach MTP head");
    let on = SpecOptions {
        mode: SpecMode::On,
        draft_max: 3,
        adaptive: true,
        sampled_verify: SampledVerify::Rejection,
    };
    let req = sampled_req(req.prompt_tokens.clone(), 10);
    let (ar, ..) = samples(&mut e, &req, SpecOptions::default(), runs);
    let (sp, drafted, accepted, lookup) = samples(&mut e, &req, on, runs);
    assert!(
        lookup > 0 && lookup < drafted,
        "both drafters drafted: lookup {lookup} of {drafted}"
    );
    assert!(accepted > 0 && drafted > accepted);
    for w in [0..3, 5..8] {
        let (stat, df, z) = chi_square(&window(&ar, w.clone()), &window(&sp, w.clone()));
        eprintln!("smollm2 on tokens {w:?}: chi2 {stat:.1} df {df} z {z:.2}; drafted {drafted} (lookup {lookup}) accepted {accepted}");
        assert!(
            z < 3.09,
            "on: the law of tokens {w:?} differs from AR (chi2 {stat:.1}, df {df}, z {z:.2})"
        );
    }
}

/// Drafter-invariant sampling on a real model: SmolLM2 with its trained MTP head and n-gram
/// lookup beside it (`on`), and n-gram alone, seeded at temperature 0.8 and 1 (top-p 0.95 on
/// some): every output is byte-identical to plain decoding with the same seed, and the head's
/// drafts are accepted (coupled drafts agree with the target's draws).
#[test]
fn smollm2_seeded_sampling_with_speculation_is_plain_decoding() {
    let path = common::model_path("smollm2-135m-instruct");
    let mut e = Engine::load(&path, "smollm2", LoadOptions::default()).expect("load");
    e.attach_mtp_head(&common::head_path("smollm2-135m-instruct", "mtp"))
        .expect("attach MTP head");
    let prompts = [
        "Write a Python function that returns the n-th Fibonacci number.",
        "List the planets of the solar system, one per line.",
        "red green blue, red green blue, red green blue, red green",
    ];
    let (mut drafted, mut accepted) = (0, 0);
    for (i, text) in prompts.iter().enumerate() {
        let prompt = e.chat_prompt_tokens(&[ChatMessage::new("user", text)]).expect("prompt");
        for seed in 0..3u64 {
            let mut r = sampled_req(prompt.clone(), 48);
            r.logprobs = Some(1);
            r.sampling.seed = Some(seed);
            r.sampling.temperature = if seed == 0 { 1.0 } else { 0.8 };
            if seed == 2 {
                r.sampling.top_p = 0.95;
            }
            for opts in [coupled(SpecMode::On, 4, true), coupled(SpecMode::Ngram, 4, true)] {
                let sp = assert_same(&mut e, &r, opts, &format!("prompt {i} seed {seed} {:?}", opts.mode));
                assert_eq!(sp.stats.spec.verify, "coupled");
                if opts.mode == SpecMode::On {
                    drafted += sp.stats.spec.drafted;
                    accepted += sp.stats.spec.accepted;
                }
            }
        }
    }
    eprintln!("smollm2 coupled on: drafted {drafted} accepted {accepted}");
    assert!(
        accepted > 0 && accepted < drafted,
        "drafted {drafted} accepted {accepted}"
    );
    // The trained block drafter, a full block drafted in one pass, coupled.
    e.attach_block_drafter(&common::head_path("smollm2-135m-instruct", "drafter"))
        .expect("attach block drafter");
    let prompt = e
        .chat_prompt_tokens(&[ChatMessage::new("user", prompts[0])])
        .expect("prompt");
    let mut r = sampled_req(prompt, 40);
    r.sampling.seed = Some(11);
    let sp = assert_same(&mut e, &r, coupled(SpecMode::Block, 7, false), "block drafter");
    assert_eq!(sp.stats.spec.decode_path, "block");
    assert!(sp.stats.spec.accepted > 0, "{:?}", sp.stats.spec);
}

/// The G-gate: for each chosen prompt (all when `prompt_ids` is empty), greedy output with
/// speculation (`mode`, each (k, adaptive)) equals plain AR output in everything a client sees.
/// `max_tokens` caps the prompts' own limits (CI subsets).
fn gate(
    model: &str,
    draft: Option<&str>,
    mode: SpecMode,
    prompt_ids: &[&str],
    configs: &[(usize, bool)],
    max_tokens: Option<usize>,
) {
    let mut e = Engine::load(&common::model_path(model), model, LoadOptions::default()).expect("load");
    if let Some(d) = draft {
        e.attach_draft_model(&common::model_path(d), d).expect("attach draft");
    }
    // The trained native drafters committed under heads/ (made by `specula distill`).
    match mode {
        // `on` with the trained MTP head: the head, with n-gram lookup beside it.
        SpecMode::Mtp | SpecMode::On => e
            .attach_mtp_head(&common::head_path(model, "mtp"))
            .expect("attach MTP head"),
        SpecMode::Block => e
            .attach_block_drafter(&common::head_path(model, "drafter"))
            .expect("attach block drafter"),
        _ => {}
    }
    assert!(e.model().batch_invariant(), "{model} runs on batch-invariant kernels");
    let prompts = common::fixture_lines("prompts.jsonl");
    let (mut drafted, mut accepted, mut steps, mut committed, mut n) = (0, 0, 0, 0, 0);
    let (mut lookup_drafted, mut lookup_accepted) = (0, 0);
    for p in prompts
        .iter()
        .filter(|p| prompt_ids.is_empty() || prompt_ids.contains(&p["id"].as_str().unwrap_or("")))
    {
        let messages: Vec<ChatMessage> = serde_json::from_value(p["messages"].clone()).expect("messages");
        let tokens = e.chat_prompt_tokens(&messages).expect("prompt");
        let own = p["max_tokens"].as_u64().unwrap_or(128) as usize;
        let mut req = greedy_req(tokens, max_tokens.map_or(own, |m| m.min(own)));
        req.ignore_eos = false;
        req.logprobs = None;
        let ar = run(&mut e, &req);
        for &(k, adaptive) in configs {
            let what = format!("{model} {mode:?} {} k={k} adaptive={adaptive}", p["id"]);
            let out = assert_same_as(&mut e, &ar, &req, self::mode(mode, k, adaptive), &what);
            drafted += out.stats.spec.drafted;
            accepted += out.stats.spec.accepted;
            lookup_drafted += out.stats.spec.lookup_drafted;
            lookup_accepted += out.stats.spec.lookup_accepted;
            steps += out.stats.spec.target_steps;
            committed += out.stats.spec.committed;
            n += 1;
        }
    }
    eprintln!(
        "{model} {mode:?} G-gate: {n} runs byte-identical to AR; drafted {drafted}, accepted {accepted} ({:.1}%), tau {:.2}; of them by lookup beside the model drafter: drafted {lookup_drafted}, accepted {lookup_accepted}",
        100.0 * accepted as f64 / drafted.max(1) as f64,
        committed as f64 / steps.max(1) as f64
    );
    assert!(drafted > 0, "speculation ran");
    if mode == SpecMode::On && draft.is_none() {
        // Both drafters of `on` proposed drafts that were verified.
        assert!(
            lookup_drafted > 0 && lookup_drafted < drafted,
            "lookup drafted {lookup_drafted} of {drafted}"
        );
    }
}

fn smollm2_gate(prompt_ids: &[&str], configs: &[(usize, bool)]) {
    gate(
        "smollm2-135m-instruct",
        None,
        SpecMode::Ngram,
        prompt_ids,
        configs,
        None,
    );
}

const ALL_K: &[(usize, bool)] = &[(1, false), (2, false), (4, false), (8, false), (8, true)];
const QWEN_SMALL: &str = "qwen2.5-coder-0.5b-instruct";
const QWEN_TARGET: &str = "qwen2.5-coder-1.5b-instruct";

/// CI subset of the draft-model G-gate on the real pair (1.5B target, 0.5B draft): one code and
/// one prose prompt, 48 tokens, k = 4 fixed and adaptive.
#[test]
fn qwen_pair_draft_model_greedy_is_byte_identical_to_ar() {
    gate(
        QWEN_TARGET,
        Some(QWEN_SMALL),
        SpecMode::Draft,
        &["p16", "p00"],
        &[(4, false), (8, true)],
        Some(48),
    );
}

/// CI subset of the n-gram G-gate on the Qwen models (their K-quant kernels are invariant too).
#[test]
fn qwen_ngram_greedy_is_byte_identical_to_ar() {
    gate(
        QWEN_SMALL,
        None,
        SpecMode::Ngram,
        &["p24", "p42"],
        &[(4, false), (8, true)],
        Some(64),
    );
}

/// Full draft-model G-gate: every prompt, k in {1, 2, 4, 8} and adaptive (slow tier:
/// `cargo test --release -p specula-engine --test spec qwen_pair_full -- --ignored --nocapture`).
#[test]
#[ignore]
fn qwen_pair_full_matrix() {
    gate(QWEN_TARGET, Some(QWEN_SMALL), SpecMode::Draft, &[], ALL_K, None);
}

/// Full n-gram G-gate on both Qwen models (slow tier).
#[test]
#[ignore]
fn qwen_ngram_full_matrix() {
    gate(QWEN_SMALL, None, SpecMode::Ngram, &[], ALL_K, None);
    gate(QWEN_TARGET, None, SpecMode::Ngram, &[], ALL_K, None);
}

/// CI subset of the G-gate: 6 prompts (2 per kind), k in {1, 2, 4, 8} and adaptive.
#[test]
fn smollm2_ngram_greedy_is_byte_identical_to_ar() {
    smollm2_gate(
        &["p00", "p08", "p16", "p18", "p40", "p46"],
        &[(1, false), (2, false), (4, false), (8, false), (8, true)],
    );
}

/// G-gate of the trained MTP head committed for SmolLM2 (`heads/`): greedy output on every
/// shared prompt is byte-identical to AR, drafting 3 tokens per step (chained depth 3), and
/// with the adaptive controller (drafts cut by the head's calibrated confidence).
#[test]
fn smollm2_trained_mtp_head_greedy_is_byte_identical_to_ar() {
    gate(
        "smollm2-135m-instruct",
        None,
        SpecMode::Mtp,
        &[],
        &[(3, false), (4, true)],
        None,
    );
}

/// G-gate of `on` with the trained MTP head attached: the head and n-gram lookup beside it,
/// the drafter chosen per step; every shared prompt, adaptive k ≤ 4 (what a server with the
/// head runs by default).
#[test]
fn smollm2_on_mtp_head_with_lookup_greedy_is_byte_identical_to_ar() {
    gate("smollm2-135m-instruct", None, SpecMode::On, &[], &[(4, true)], None);
}

/// G-gate of the trained block drafter committed for SmolLM2: every shared prompt, a full block
/// per step.
#[test]
fn smollm2_trained_block_drafter_greedy_is_byte_identical_to_ar() {
    gate("smollm2-135m-instruct", None, SpecMode::Block, &[], &[(7, false)], None);
}

/// Both trained drafters at every k and adaptive (slow tier:
/// `cargo test --release -p specula-engine --test spec trained_full -- --ignored --nocapture`).
#[test]
#[ignore]
fn smollm2_trained_full_matrix() {
    gate("smollm2-135m-instruct", None, SpecMode::Mtp, &[], ALL_K, None);
    gate("smollm2-135m-instruct", None, SpecMode::On, &[], ALL_K, None);
    gate("smollm2-135m-instruct", None, SpecMode::Block, &[], ALL_K, None);
}

/// The full G-gate matrix for n-gram on SmolLM2: every prompt, every k (slow tier:
/// `cargo test --release -p specula-engine --test spec -- --ignored --nocapture`).
#[test]
#[ignore]
fn smollm2_ngram_full_matrix() {
    smollm2_gate(&[], &[(1, false), (2, false), (4, false), (8, false), (8, true)]);
}

#[test]
fn a_reduced_logit_set_keeps_the_full_heads_bits() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = write_tiny(
        dir.path(),
        "m.gguf",
        TinySpec {
            dtype: GgmlDType::Q8_0,
            ..TinySpec::new(Family::Qwen2)
        },
    );
    let full = specula_engine::bundle::load(&path, &candle_core::Device::Cpu)
        .expect("load")
        .model;
    let mut part = specula_engine::bundle::load(&path, &candle_core::Device::Cpu)
        .expect("load")
        .model;
    let vocab = full.config.vocab_size;
    let keep: Vec<u32> = (0..vocab as u32).filter(|t| t % 3 == 1).collect();
    assert_eq!(part.logit_rows(), vocab);
    part.restrict_logits(&keep).expect("restrict");
    assert_eq!(part.logit_rows(), keep.len());
    let tokens = [5u32, 9, 2, 7];
    let logits = |m: &specula_engine::model::Model| {
        let mut kv = m.new_kv_cache();
        let out = m
            .forward(&tokens, &mut kv, specula_engine::model::LogitsRows::All, &[])
            .expect("forward");
        out.logits
            .flatten_all()
            .expect("flatten")
            .to_vec1::<f32>()
            .expect("values")
    };
    let (a, b) = (logits(&full), logits(&part));
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        if (i % vocab) % 3 == 1 {
            assert_eq!(x.to_bits(), y.to_bits(), "logit {i}");
        } else {
            assert_eq!(*y, f32::NEG_INFINITY, "logit {i}");
        }
    }
    let e = part.restrict_logits(&[vocab as u32]).unwrap_err().to_string();
    assert!(e.contains("outside the vocabulary"), "{e}");
}

#[test]
fn a_reduced_draft_vocabulary_keeps_greedy_output() {
    // The draft model has the target's weights, so it agrees with every target token it can
    // propose; one token of the output is left out of its vocabulary, so drafts fail there.
    let (_d, mut e) = tiny_pair(Draft::Same);
    let prompt = e.tokenize("the then the thin").expect("tokenize");
    let req = greedy_req(prompt, 90);
    let ar = assert_same(&mut e, &req, mode(SpecMode::Draft, 4, false), "full vocabulary");
    assert_eq!(ar.stats.spec.accepted, ar.stats.spec.drafted);
    let mut seen = Vec::new();
    for &t in &ar.token_ids {
        if !seen.contains(&t) && !e.eos_ids().contains(&t) {
            seen.push(t);
        }
    }
    assert!(seen.len() > 2, "{seen:?}");
    // Leave out the most frequent token of the output.
    let count = |t: u32| ar.token_ids.iter().filter(|&&x| x == t).count();
    let (i, _) = seen.iter().enumerate().max_by_key(|(_, &t)| count(t)).expect("tokens");
    let left_out = seen.remove(i);
    let n = e.reduce_draft_vocab(&seen, seen.len()).expect("reduce");
    assert_eq!(n, seen.len() + e.eos_ids().iter().filter(|t| !seen.contains(t)).count());
    let (mut drafted, mut accepted) = (0, 0);
    for (k, adaptive) in [(1, false), (4, false), (4, true)] {
        let out = assert_same(
            &mut e,
            &req,
            mode(SpecMode::Draft, k, adaptive),
            &format!("reduced k={k}"),
        );
        drafted += out.stats.spec.drafted;
        accepted += out.stats.spec.accepted;
    }
    assert!(drafted > 0);
    assert!(
        accepted < drafted,
        "token {left_out} cannot be drafted, so some drafts fail"
    );
}
