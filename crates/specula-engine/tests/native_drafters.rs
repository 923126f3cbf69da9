//! Native drafters (MTP heads): random-weight heads in both tensor layouts load from test
//! bundles, draft, and pass the G-gate (greedy output byte-identical to AR) on tiny random
//! targets; a head that does not fit its target is refused with the file and tensor named.

use candle_core::quantized::GgmlDType;
use specula_engine::model::Family;
use specula_engine::spec::mtp::MtpLayout;
use specula_engine::spec::{SpecMode, SpecOptions};
use specula_engine::testing::{write_random_mtp_head, write_tiny_gguf, TinySpec};
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

fn req(prompt: Vec<u32>, mode: SpecMode, k: usize, sampling: SamplingParams) -> GenerateRequest {
    GenerateRequest {
        prompt_tokens: prompt,
        sampling,
        max_tokens: Some(100),
        stop: vec![],
        logprobs: Some(2),
        ignore_eos: true,
        spec: SpecOptions {
            mode,
            draft_max: k,
            adaptive: false,
        },
    }
}

fn run(e: &mut Engine, r: &GenerateRequest) -> GenerateOutput {
    e.generate(r, &mut |_| true).expect("generate")
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
                let sp = run(&mut e, &req(prompt.clone(), SpecMode::Mtp, k, SamplingParams::greedy()));
                assert_eq!(sp.stats.spec.decode_path, "mtp", "{what}");
                assert!(sp.stats.spec.drafted > 0, "{what}: the head drafted nothing");
                assert_eq!(ar.text.as_bytes(), sp.text.as_bytes(), "{what}: text");
                assert_eq!(ar.token_ids, sp.token_ids, "{what}: token ids");
                assert_eq!(ar.logprobs, sp.logprobs, "{what}: logprobs");
                assert_eq!(ar.finish_reason, sp.finish_reason, "{what}: finish reason");
                if reduced {
                    // Every draft token comes from the draft vocabulary.
                    assert!(sp.stats.spec.drafted_by_position.len() <= k, "{what}");
                }
            }
            // `on` picks the MTP head when no draft model is attached.
            let on = run(&mut e, &req(prompt.clone(), SpecMode::On, 4, SamplingParams::greedy()));
            assert_eq!(on.stats.spec.decode_path, "mtp");
            assert_eq!(on.token_ids, ar.token_ids);
            // Sampling requests draft from the head's distribution (rejection sampling); same
            // seed, same output.
            let sampling = SamplingParams {
                temperature: 0.8,
                seed: Some(3),
                ..SamplingParams::greedy()
            };
            let a = run(&mut e, &req(prompt.clone(), SpecMode::Mtp, 4, sampling.clone()));
            let b = run(&mut e, &req(prompt.clone(), SpecMode::Mtp, 4, sampling));
            assert_eq!(a.token_ids, b.token_ids, "{family:?} {layout:?}: seeded sampling repeats");
            assert!(a.stats.spec.drafted > 0);
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
    assert!(err.contains("draft_vocab") && err.contains(&(v + 5).to_string()), "{err}");
    // `--spec mtp` without a head is a request error, not a silent fallback.
    let prompt = e.tokenize("the then").expect("tokenize");
    let r = req(prompt, SpecMode::Mtp, 4, SamplingParams::greedy());
    assert!(e.generate(&r, &mut |_| true).is_err());
}
