//! Native drafters (MTP heads, block drafters): random-weight heads in both MTP tensor layouts
//! and random block drafters load from test bundles, draft, and pass the G-gate (greedy output byte-identical to AR) on tiny random
//! targets; a head that does not fit its target is refused with the file and tensor named.

mod common;

use common::{req, run};

use candle_core::quantized::GgmlDType;
use specula_engine::model::Family;
use specula_engine::speculative::mtp::MtpLayout;
use specula_engine::speculative::{SampledVerify, SpecMode};
use specula_engine::testing::{
    write_random_block_drafter, write_random_fused_mtp_head, write_random_mtp_head, write_tiny_gguf, TinySpec,
};
use specula_engine::{Engine, GenerateOutput, GenerateRequest, LoadOptions, SamplingParams};

fn tiny(family: Family, dtype: GgmlDType) -> (tempfile::TempDir, Engine) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    write_tiny_gguf(
        &path,
        &TinySpec {
            dtype,
            ..TinySpec::new(family)
        },
    )
    .expect("write");
    let e = Engine::load(&path, "tiny", LoadOptions::default()).expect("load");
    (dir, e)
}

/// Greedy decoding of `prompt` with the attached MTP head at fixed `k`: it drafts, and its text,
/// token ids and logprobs are AR's (`ar`). Returns the speculative output.
fn mtp_matches_ar(e: &mut Engine, prompt: &[u32], ar: &GenerateOutput, k: usize, what: &str) -> GenerateOutput {
    let sp = run(e, &req(prompt.to_vec(), SpecMode::Mtp, k, SamplingParams::greedy()));
    assert_eq!(sp.stats.spec.decode_path, "mtp", "{what}");
    assert!(sp.stats.spec.drafted > 0, "{what}: the head drafted nothing");
    assert_eq!(ar.text.as_bytes(), sp.text.as_bytes(), "{what}: text");
    assert_eq!(ar.token_ids, sp.token_ids, "{what}: token ids");
    assert_eq!(ar.logprobs, sp.logprobs, "{what}: logprobs");
    sp
}

/// Run `reqs` one by one, then all together through the engine's batched steps: each batched
/// request must give its solo output's token ids, decode path and draft count. Returns the
/// solo outputs.
fn batched_matches_solo(e: &mut Engine, reqs: &[GenerateRequest], what: &str) -> Vec<GenerateOutput> {
    let solo: Vec<GenerateOutput> = reqs.iter().map(|r| run(e, r)).collect();
    for (i, out) in common::run_batch(e, reqs, 500, what).into_iter().enumerate() {
        let spec = (&out.stats.spec.decode_path, out.stats.spec.drafted);
        assert_eq!(out.token_ids, solo[i].token_ids, "{what}: request {i}");
        assert_eq!(
            spec,
            (&solo[i].stats.spec.decode_path, solo[i].stats.spec.drafted),
            "{what}: request {i}, decode path and drafts"
        );
    }
    solo
}

#[test]
fn random_mtp_heads_in_both_layouts_draft_and_match_ar() {
    for (family, dtype) in [
        (Family::Llama, GgmlDType::Q4_1),
        (Family::Qwen2, GgmlDType::Q8_0),
        (Family::Qwen3, GgmlDType::Q5_0),
    ] {
        for (layout, reduced) in [
            (MtpLayout::DeepseekV3, false),
            (MtpLayout::Qwen3Next, false),
            (MtpLayout::DeepseekV3, true),
        ] {
            let (dir, mut e) = tiny(family, dtype);
            let head_dir = dir.path().join("head");
            let vocab: Vec<u32> = (0..e.config().vocab_size as u32).step_by(3).collect();
            write_random_mtp_head(&head_dir, e.model(), layout, reduced.then_some(vocab.as_slice()), 7)
                .expect("write head");
            e.attach_mtp_head(&head_dir).expect("attach");
            let head = e.mtp_head().expect("attached");
            assert_eq!(head.layout, layout);
            assert_eq!(head.vocab.ids.is_some(), reduced);
            let prompt = e.tokenize("the then the thin the then").expect("tokenize");
            let ar = run(&mut e, &req(prompt.clone(), SpecMode::Off, 1, SamplingParams::greedy()));
            for k in [1, 3, 6] {
                let what = format!("{family:?} {layout:?} reduced={reduced} k={k}");
                let sp = mtp_matches_ar(&mut e, &prompt, &ar, k, &what);
                assert_eq!(ar.finish_reason, sp.finish_reason, "{what}: finish reason");
                if reduced {
                    // Every draft token comes from the draft vocabulary.
                    assert!(sp.stats.spec.drafted_by_position.len() <= k, "{what}");
                }
            }
            // `on` picks the MTP head when no draft model is attached: alone with a fixed k,
            // with n-gram lookup beside it with adaptive k.
            let mut on_req = req(prompt.clone(), SpecMode::On, 4, SamplingParams::greedy());
            let on = run(&mut e, &on_req);
            assert_eq!(on.stats.spec.decode_path, "mtp");
            assert_eq!(on.token_ids, ar.token_ids);
            on_req.spec.adaptive = true;
            let on = run(&mut e, &on_req);
            assert_eq!(on.stats.spec.decode_path, "mtp+ngram");
            assert_eq!(on.token_ids, ar.token_ids);
            // Sampled requests verify by coupling (the default): the head draws its drafts from
            // its distribution with the target's key, and a seeded output is the seed's plain
            // output.
            let sampling = SamplingParams {
                temperature: 0.8,
                seed: Some(3),
                ..SamplingParams::greedy()
            };
            let a_sampling = sampling.clone();
            let a = run(&mut e, &req(prompt.clone(), SpecMode::Mtp, 4, sampling.clone()));
            let b = run(&mut e, &req(prompt.clone(), SpecMode::Off, 4, sampling));
            assert_eq!(
                a.token_ids, b.token_ids,
                "{family:?} {layout:?}: seeded sampling with the head is plain sampling"
            );
            assert_eq!(a.stats.spec.verify, "coupled");
            assert!(a.stats.spec.drafted > 0);
            // Rejection sampling: the head's sampled drafts carry q; with a fixed k the same
            // seed repeats its output.
            let mut rej = req(prompt.clone(), SpecMode::Mtp, 4, a_sampling.clone());
            rej.spec.sampled_verify = SampledVerify::Rejection;
            let (r1, r2) = (run(&mut e, &rej), run(&mut e, &rej));
            assert_eq!(
                r1.token_ids, r2.token_ids,
                "{family:?} {layout:?}: seeded rejection repeats"
            );
            assert_eq!(r1.stats.spec.verify, "rejection");
            assert!(r1.stats.spec.drafted > 0);
        }
    }
}

#[test]
fn mtp_head_that_does_not_fit_is_refused_naming_file_and_tensor() {
    let (dir, mut e) = tiny(Family::Llama, GgmlDType::Q8_0);
    // A head written for a wider model (hidden 128 instead of 64).
    let (_d2, wide) = {
        let d = tempfile::tempdir().expect("tempdir");
        let p = d.path().join("wide.gguf");
        write_tiny_gguf(
            &p,
            &TinySpec {
                hidden: 128,
                dtype: GgmlDType::Q8_0,
                ..TinySpec::new(Family::Llama)
            },
        )
        .expect("write");
        let e = Engine::load(&p, "wide", LoadOptions::default()).expect("load");
        (d, e)
    };
    let head_dir = dir.path().join("wide-head");
    write_random_mtp_head(&head_dir, wide.model(), MtpLayout::DeepseekV3, None, 1).expect("write");
    let err = format!("{:#}", e.attach_mtp_head(&head_dir).expect_err("must be refused"));
    assert!(err.contains("model.safetensors"), "{err}");
    assert!(err.contains("enorm.weight") || err.contains("eh_proj.weight"), "{err}");
    assert!(e.mtp_head().is_none());
    // A draft vocabulary with an id outside the target's vocabulary.
    let bad_dir = dir.path().join("bad-vocab");
    let v = e.config().vocab_size as u32;
    write_random_mtp_head(&bad_dir, e.model(), MtpLayout::DeepseekV3, Some(&[0, 1, v + 5]), 1).expect("write");
    let err = format!("{:#}", e.attach_mtp_head(&bad_dir).expect_err("must be refused"));
    assert!(
        err.contains("draft_vocab") && err.contains(&(v + 5).to_string()),
        "{err}"
    );
    // `--spec mtp` without a head is a request error, not a silent fallback.
    let prompt = e.tokenize("the then").expect("tokenize");
    let r = req(prompt, SpecMode::Mtp, 4, SamplingParams::greedy());
    assert!(e.generate(&r, &mut |_| true).is_err());
}

/// A fused-feature MTP head (EAGLE-3: several target layers' outputs through `hidden_fc`) in
/// either layout reads every listed tap, drafts, and greedy output with it is AR's, alone and
/// batched beside a one-tap request; a head whose file and config disagree is refused.
#[test]
fn fused_feature_mtp_heads_draft_and_match_ar() {
    for (family, layout) in [
        (Family::Llama, MtpLayout::DeepseekV3),
        (Family::Qwen2, MtpLayout::Qwen3Next),
    ] {
        let (dir, mut e) = tiny(family, GgmlDType::Q8_0);
        let layers = e.config().num_layers;
        let taps = [0, layers - 1];
        let head_dir = dir.path().join("fused");
        write_random_fused_mtp_head(&head_dir, e.model(), layout, None, Some(&taps), 11).expect("write head");
        e.attach_mtp_head(&head_dir).expect("attach");
        let head = e.mtp_head().expect("attached");
        assert_eq!(head.taps, taps.to_vec());
        assert!(head.weights.hidden_fc.is_some());
        let prompt = e.tokenize("the then the thin the then").expect("tokenize");
        let ar = run(&mut e, &req(prompt.clone(), SpecMode::Off, 1, SamplingParams::greedy()));
        for k in [1, 3] {
            mtp_matches_ar(&mut e, &prompt, &ar, k, &format!("{family:?} {layout:?} k={k}"));
        }
        // Batched with an n-gram request (no taps) and a plain one: the same outputs.
        let reqs = [
            req(prompt.clone(), SpecMode::Mtp, 3, SamplingParams::greedy()),
            req(prompt.clone(), SpecMode::Ngram, 3, SamplingParams::greedy()),
            req(prompt[..4].to_vec(), SpecMode::Mtp, 2, SamplingParams::greedy()),
        ];
        batched_matches_solo(&mut e, &reqs, &format!("{family:?}"));
    }

    let (dir, mut e) = tiny(Family::Llama, GgmlDType::Q8_0);
    let layers = e.config().num_layers;
    // `inspect` finds a fused head given as the drafter (its config lists `target_layer_ids`,
    // as a block drafter's does, but it is an MTP head) and checks `hidden_fc`'s shape.
    let good = dir.path().join("good");
    write_random_fused_mtp_head(&good, e.model(), MtpLayout::DeepseekV3, None, Some(&[0, 1]), 2).expect("write");
    let opts = |d: &std::path::Path| specula_engine::inspect::InspectOptions {
        drafter: Some(d.to_path_buf()),
        ..Default::default()
    };
    let report = specula_engine::inspect::inspect(&dir.path().join("tiny.gguf"), &opts(&good)).expect("inspect");
    assert_eq!(
        report.capabilities.mtp.status,
        specula_engine::inspect::MtpStatus::Present,
        "{:?}",
        report.diagnostics
    );
    assert!(report.capabilities.block_drafter.is_none());
    let h = e.config().hidden_size;
    let bad_fc = dir.path().join("bad-fc");
    std::fs::create_dir_all(&bad_fc).expect("dir");
    std::fs::copy(good.join("config.json"), bad_fc.join("config.json")).expect("copy");
    let mut t =
        candle_core::safetensors::load(good.join("model.safetensors"), &candle_core::Device::Cpu).expect("load");
    let fc = format!("model.layers.{layers}.hidden_fc.weight");
    t.insert(
        fc.clone(),
        candle_core::Tensor::zeros((h, 2 * h + 3), candle_core::DType::F32, &candle_core::Device::Cpu).expect("zeros"),
    );
    candle_core::safetensors::save(&t, bad_fc.join("model.safetensors")).expect("save");
    let report = specula_engine::inspect::inspect(&dir.path().join("tiny.gguf"), &opts(&bad_fc)).expect("inspect");
    assert_eq!(
        report.capabilities.mtp.status,
        specula_engine::inspect::MtpStatus::Invalid
    );
    assert!(
        report.diagnostics.iter().any(|d| d.subject == fc),
        "{:?}",
        report.diagnostics
    );
    // The file has `hidden_fc` but the config lists no target layers.
    let no_ids = dir.path().join("no-ids");
    write_random_fused_mtp_head(&no_ids, e.model(), MtpLayout::DeepseekV3, None, Some(&[0, 1]), 2).expect("write");
    let cfg_path = no_ids.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).expect("config")).expect("json");
    cfg.as_object_mut().expect("object").remove("target_layer_ids");
    std::fs::write(&cfg_path, cfg.to_string()).expect("write config");
    let err = format!("{:#}", e.attach_mtp_head(&no_ids).expect_err("must be refused"));
    assert!(
        err.contains("hidden_fc.weight") && err.contains("target_layer_ids"),
        "{err}"
    );
    // Three layers listed, two in the file.
    cfg["target_layer_ids"] = serde_json::json!([0, 1, 1]);
    std::fs::write(&cfg_path, cfg.to_string()).expect("write config");
    let err = format!("{:#}", e.attach_mtp_head(&no_ids).expect_err("must be refused"));
    assert!(
        err.contains("hidden_fc.weight") && err.contains("model.safetensors"),
        "{err}"
    );
    // A layer the target does not have.
    cfg["target_layer_ids"] = serde_json::json!([0, layers]);
    std::fs::write(&cfg_path, cfg.to_string()).expect("write config");
    let err = format!("{:#}", e.attach_mtp_head(&no_ids).expect_err("must be refused"));
    assert!(
        err.contains("target_layer_ids") && err.contains(&layers.to_string()),
        "{err}"
    );
    assert!(e.mtp_head().is_none());
}

#[test]
fn random_block_drafters_draft_a_block_and_match_ar() {
    for (family, dtype) in [
        (Family::Llama, GgmlDType::Q4_1),
        (Family::Qwen2, GgmlDType::Q8_0),
        (Family::Qwen3, GgmlDType::Q5_0),
    ] {
        let (dir, mut e) = tiny(family, dtype);
        let bd = dir.path().join("tiny.drafter");
        write_random_block_drafter(&bd, e.model(), 8, &[0, 1], 1, 5).expect("write");
        e.attach_block_drafter(&bd).expect("attach");
        assert_eq!(e.block_drafter().expect("attached").taps, vec![0, 1]);
        let prompt = e.tokenize("the then the thin the then").expect("tokenize");
        let ar = run(&mut e, &req(prompt.clone(), SpecMode::Off, 1, SamplingParams::greedy()));
        for k in [1, 4, 7, 12] {
            let what = format!("{family:?} block k={k}");
            let sp = run(
                &mut e,
                &req(prompt.clone(), SpecMode::Block, k, SamplingParams::greedy()),
            );
            assert_eq!(sp.stats.spec.decode_path, "block", "{what}");
            assert!(sp.stats.spec.drafted > 0, "{what}: nothing drafted");
            // One pass drafts at most block_size - 1 tokens.
            assert!(sp.stats.spec.drafted_by_position.len() <= k.min(7), "{what}");
            assert_eq!(ar.text.as_bytes(), sp.text.as_bytes(), "{what}: text");
            assert_eq!(ar.token_ids, sp.token_ids, "{what}: token ids");
            assert_eq!(ar.logprobs, sp.logprobs, "{what}: logprobs");
        }
        let sampling = SamplingParams {
            temperature: 0.8,
            seed: Some(9),
            ..SamplingParams::greedy()
        };
        let a_sampling = sampling.clone();
        let a = run(&mut e, &req(prompt.clone(), SpecMode::Block, 4, sampling.clone()));
        let b = run(&mut e, &req(prompt.clone(), SpecMode::Off, 4, sampling));
        assert_eq!(
            a.token_ids, b.token_ids,
            "{family:?}: seeded sampling with the block drafter is plain sampling"
        );
        assert!(a.stats.spec.drafted > 0);
        let mut rej = req(prompt.clone(), SpecMode::Block, 4, a_sampling);
        rej.spec.sampled_verify = SampledVerify::Rejection;
        let (r1, r2) = (run(&mut e, &rej), run(&mut e, &rej));
        assert_eq!(r1.token_ids, r2.token_ids, "{family:?}: seeded rejection repeats");
        assert_eq!(r1.stats.spec.verify, "rejection");
    }
}

#[test]
fn block_drafter_config_errors_name_the_file_and_field() {
    let (dir, mut e) = tiny(Family::Llama, GgmlDType::Q8_0);
    let layers = e.config().num_layers;
    let bd = dir.path().join("bad.drafter");
    write_random_block_drafter(&bd, e.model(), 8, &[0, layers + 3], 1, 5).expect("write");
    let err = format!("{:#}", e.attach_block_drafter(&bd).expect_err("layer out of range"));
    assert!(err.contains("config.json") && err.contains("target_layer_ids"), "{err}");
    // fc.weight sized for one layer while the config names two.
    let bd2 = dir.path().join("bad2.drafter");
    write_random_block_drafter(&bd2, e.model(), 8, &[0], 1, 5).expect("write");
    let cfg = bd2.join("config.json");
    let text = std::fs::read_to_string(&cfg)
        .expect("read")
        .replace("\"target_layer_ids\": [\n    0\n  ]", "\"target_layer_ids\": [0, 1]");
    std::fs::write(&cfg, text).expect("write");
    let err = format!("{:#}", e.attach_block_drafter(&bd2).expect_err("fc shape"));
    assert!(err.contains("fc.weight") && err.contains("expected"), "{err}");
    assert!(e.block_drafter().is_none());
}

/// Sequences with an MTP head, a block drafter, n-gram and none, stepped together in one batched
/// forward (the union of their taps), give each exactly its solo output; prompts are prefilled
/// in chunks, so the drafters observe their hidden states piece by piece.
#[test]
fn native_drafters_in_a_batch_match_their_solo_runs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    write_tiny_gguf(&path, &TinySpec::with_dtype(Family::Qwen3, GgmlDType::Q8_0)).expect("write");
    let mut e = Engine::load(
        &path,
        "tiny",
        LoadOptions {
            prefill_chunk: 8,
            ..LoadOptions::default()
        },
    )
    .expect("load");
    let layers = e.config().num_layers;
    write_random_mtp_head(&dir.path().join("mtp"), e.model(), MtpLayout::DeepseekV3, None, 3).expect("mtp");
    write_random_block_drafter(&dir.path().join("blk"), e.model(), 5, &[0, layers - 1], 1, 4).expect("block");
    e.attach_mtp_head(&dir.path().join("mtp")).expect("attach mtp");
    e.attach_block_drafter(&dir.path().join("blk")).expect("attach block");
    let mk = |n: usize, salt: u32, mode: SpecMode| {
        let mut r = req(
            (0..n as u32).map(|i| 97 + (i * 7 + salt) % 26).collect(),
            mode,
            3,
            SamplingParams::greedy(),
        );
        r.max_tokens = Some(40);
        r
    };
    let reqs = [
        mk(5, 0, SpecMode::Mtp),
        mk(30, 1, SpecMode::Block),
        mk(21, 2, SpecMode::Off),
        mk(17, 3, SpecMode::Ngram),
        mk(12, 4, SpecMode::Mtp),
    ];
    let solo = batched_matches_solo(&mut e, &reqs, "mixed drafters");
    assert!(solo[0].stats.spec.drafted > 0 && solo[1].stats.spec.drafted > 0);
}

/// A prefix-cache hit skips the cached prompt rows, so a native drafter never sees their hidden
/// states: it drafts from the rows it observed, and the output is still AR's.
#[test]
fn native_drafters_after_a_prefix_cache_hit_stay_exact() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("tiny.gguf");
    write_tiny_gguf(&path, &TinySpec::with_dtype(Family::Llama, GgmlDType::Q8_0)).expect("write");
    let mut e = Engine::load(
        &path,
        "tiny",
        LoadOptions {
            prefix_cache_bytes: 1 << 24,
            ..LoadOptions::default()
        },
    )
    .expect("load");
    write_random_mtp_head(&dir.path().join("mtp"), e.model(), MtpLayout::Qwen3Next, None, 3).expect("mtp");
    write_random_block_drafter(&dir.path().join("blk"), e.model(), 4, &[1], 1, 4).expect("block");
    e.attach_mtp_head(&dir.path().join("mtp")).expect("attach mtp");
    e.attach_block_drafter(&dir.path().join("blk")).expect("attach block");
    let prompt: Vec<u32> = (0..70u32).map(|i| 97 + (i * 5) % 26).collect();
    let ar = run(&mut e, &req(prompt.clone(), SpecMode::Off, 1, SamplingParams::greedy()));
    for mode in [SpecMode::Mtp, SpecMode::Block] {
        let out = run(&mut e, &req(prompt.clone(), mode, 3, SamplingParams::greedy()));
        assert!(
            out.stats.cached_prompt_tokens >= 64,
            "{mode:?}: {}",
            out.stats.cached_prompt_tokens
        );
        assert!(out.stats.spec.drafted > 0, "{mode:?}");
        assert_eq!(out.token_ids, ar.token_ids, "{mode:?}");
    }
}

/// With a trained attention window shorter than the prompt, both drafters skip the rows no
/// later row can see (bounded catch-up after a long prompt or a pause) and stay exact.
#[test]
fn native_drafters_with_an_attention_window_stay_exact() {
    let (dir, mut e) = tiny(Family::Qwen2, GgmlDType::Q8_0);
    let layers = e.config().num_layers;
    let set_window = |p: &std::path::Path| {
        let cfg = p.join("config.json");
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&cfg).expect("read")).expect("json");
        v["attention_window"] = serde_json::json!(6);
        std::fs::write(&cfg, v.to_string()).expect("write");
    };
    write_random_mtp_head(&dir.path().join("mtp"), e.model(), MtpLayout::DeepseekV3, None, 3).expect("mtp");
    write_random_block_drafter(&dir.path().join("blk"), e.model(), 4, &[0, layers - 1], 1, 4).expect("block");
    set_window(&dir.path().join("mtp"));
    set_window(&dir.path().join("blk"));
    e.attach_mtp_head(&dir.path().join("mtp")).expect("attach mtp");
    e.attach_block_drafter(&dir.path().join("blk")).expect("attach block");
    assert_eq!(e.mtp_head().expect("mtp").config.attention_window, Some(6));
    let prompt: Vec<u32> = (0..60u32).map(|i| 97 + (i * 11) % 26).collect();
    let ar = run(&mut e, &req(prompt.clone(), SpecMode::Off, 1, SamplingParams::greedy()));
    for mode in [SpecMode::Mtp, SpecMode::Block] {
        for k in [1, 3] {
            let out = run(&mut e, &req(prompt.clone(), mode, k, SamplingParams::greedy()));
            assert!(out.stats.spec.drafted > 0, "{mode:?}");
            assert_eq!(out.token_ids, ar.token_ids, "{mode:?} k={k}");
        }
    }
}
