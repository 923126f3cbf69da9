//! `specula distill` end to end on tiny targets: trained MTP heads and block drafters load, draft
//! tokens the target accepts, and greedy output with them is byte-identical to AR; runs resume
//! from checkpoints; a device target gives the CPU path's bits; SmolLM2 writes its own prompts.

#[path = "../../specula-engine/tests/common/mod.rs"]
mod common;

use common::{req, run};

use candle_core::quantized::GgmlDType;
use specula_engine::device::CpuSlots;
use specula_engine::model::Family;
use specula_engine::speculative::mtp::MtpLayout;
use specula_engine::speculative::SpecMode;
use specula_engine::testing::{write_random_mtp_head, write_tiny_gguf, TinySpec};
use specula_engine::{Engine, LoadOptions, SamplingParams};

fn distill_opts(out: &std::path::Path, steps: usize) -> specula_train::DistillOptions {
    specula_train::DistillOptions {
        out: out.to_path_buf(),
        prompts: 24,
        answer_tokens: 48,
        seq_len: 64,
        batch: 2,
        steps: Some(steps),
        lr: 3e-3,
        warmup: 5,
        draft_vocab: 0,
        checkpoint_every: 5,
        held_out: 0.2,
        ..Default::default()
    }
}

fn tiny_with_path(family: Family) -> (tempfile::TempDir, std::path::PathBuf, Engine) {
    let dir = tempfile::tempdir().expect("tempdir");
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
    (dir, path, e)
}

/// `specula distill` end to end on a tiny target: the trained head loads, drafts tokens the
/// target accepts, and greedy output with it is byte-identical to AR; an interrupted run resumes
/// from its checkpoint to the same weights as an uninterrupted one.
#[test]
fn distilled_mtp_head_is_accepted_exact_and_resumable() {
    let (dir, path, mut e) = tiny_with_path(Family::Qwen2);
    let full = dir.path().join("full");
    // Both chained steps trained (the second fed the head's own output).
    let chained = |out: &std::path::Path| specula_train::DistillOptions {
        chain_depth: 2,
        ..distill_opts(out, 40)
    };
    let r = specula_train::run_mtp(&mut e, &path, None, &chained(&full), &mut |_| {}).expect("distill");
    assert!(r.finished && r.steps_done == 40, "{r:?}");
    assert!(r.final_loss.is_finite());
    let first_loss = {
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(full.join("config.json")).expect("config")).expect("json");
        cfg["training"]["loss_history"][0][1].as_f64().expect("loss history")
    };
    assert!(
        r.final_loss < first_loss,
        "training lowered the loss: {first_loss} -> {}",
        r.final_loss
    );
    assert!(r.held_out_top1.is_some() && r.held_out_top1_answers.is_some());
    // The answers are a part of the held-out rows: the prompts are held out too, but only as
    // context.
    assert!(
        r.held_out_answer_rows > 0 && r.held_out_answer_rows < r.held_out_rows,
        "{} answer rows of {}",
        r.held_out_answer_rows,
        r.held_out_rows
    );
    // The second chained draft is scored on the answer rows where the first agreed: at most
    // that many rows (fewer: a window's last row has no t_{j+2}), at a rate in [0, 1].
    let first_hits = (r.held_out_top1_answers.unwrap_or(0.0) * r.held_out_answer_rows as f64).round() as usize;
    assert!(r.held_out_depth2_rows <= first_hits, "{r:?}");
    if let Some(a) = r.held_out_depth2_answers {
        assert!((0.0..=1.0).contains(&a), "{r:?}");
    }
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(full.join("config.json")).expect("config")).expect("json");
    assert_eq!(record["training"]["trained_on"], "cpu");
    assert_eq!(record["training"]["held_out_depth2_rows"], r.held_out_depth2_rows);

    // Interrupted after 12 steps, then resumed: the same head, bit for bit.
    let parts = dir.path().join("parts");
    let mut o = chained(&parts);
    o.stop_after = Some(12);
    let r1 = specula_train::run_mtp(&mut e, &path, None, &o, &mut |_| {}).expect("first part");
    assert!(!r1.finished && r1.steps_done == 12);
    assert!(!parts.join("model.safetensors").exists());
    // The checkpoint keeps the training seconds so far, and the resumed run's record adds its own.
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(parts.join("checkpoint/state.json")).expect("checkpoint state"))
            .expect("state.json");
    let before = state["seconds"].as_f64().expect("seconds in the checkpoint");
    assert!(before > 0.0 && before <= r1.seconds, "{before} {}", r1.seconds);
    o.stop_after = None;
    let r2 = specula_train::run_mtp(&mut e, &path, None, &o, &mut |_| {}).expect("resume");
    assert!(r2.finished && r2.steps_done == 40);
    assert!(r2.seconds > before, "{} {before}", r2.seconds);
    assert_eq!(
        std::fs::read(full.join("model.safetensors")).expect("full"),
        std::fs::read(parts.join("model.safetensors")).expect("parts"),
        "resumed training must end where uninterrupted training ends"
    );
    // A checkpoint of another run is not silently continued.
    let mut other = distill_opts(&parts, 50);
    other.stop_after = Some(1);
    let err = specula_train::run_mtp(&mut e, &path, None, &other, &mut |_| {}).expect_err("mismatch");
    assert!(format!("{err:#}").contains("--restart"), "{err:#}");

    // The head drafts, the target accepts some drafts, and the output is AR's.
    e.attach_mtp_head(&full).expect("attach");
    let mut accepted = 0;
    for text in ["the then the thin the then", "in the thin then", "then the"] {
        let prompt = e.tokenize(text).expect("tokenize");
        let ar = run(&mut e, &req(prompt.clone(), SpecMode::Off, 1, SamplingParams::greedy()));
        for k in [1, 3] {
            let sp = run(&mut e, &req(prompt.clone(), SpecMode::Mtp, k, SamplingParams::greedy()));
            assert_eq!(ar.text.as_bytes(), sp.text.as_bytes(), "{text:?} k={k}");
            assert_eq!(ar.token_ids, sp.token_ids, "{text:?} k={k}");
            accepted += sp.stats.spec.accepted;
        }
    }
    assert!(accepted > 0, "a trained head drafts tokens the target accepts");
}

/// `specula distill` on a Mixture-of-Experts target (a tiny Qwen3-MoE, Q8_0): the MTP head
/// (a dense block of the target's shape) trains, loads, drafts tokens the MoE target accepts,
/// and greedy output with it is byte-identical to AR, solo and in a batch.
#[test]
fn distilled_mtp_head_on_an_moe_target_is_accepted_and_exact() {
    use specula_engine::arch::qwen_moe::QwenMoe;
    use specula_engine::testing::{tiny_moe_config, write_random_gguf};
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("moe.gguf");
    write_random_gguf(
        &path,
        &QwenMoe,
        "qwen3moe",
        &tiny_moe_config("qwen3moe"),
        GgmlDType::Q8_0,
        11,
    )
    .expect("write");
    let mut e = Engine::load(&path, "tiny-moe", LoadOptions::default()).expect("load");
    let out = dir.path().join("head");
    let r = specula_train::run_mtp(&mut e, &path, None, &distill_opts(&out, 40), &mut |_| {}).expect("distill");
    assert!(r.finished && r.final_loss.is_finite(), "{r:?}");
    e.attach_mtp_head(&out).expect("attach");
    let mut accepted = 0;
    let mut reqs = Vec::new();
    for text in ["the then the thin the then", "in the thin then", "then the"] {
        let prompt = e.tokenize(text).expect("tokenize");
        let ar = run(&mut e, &req(prompt.clone(), SpecMode::Off, 1, SamplingParams::greedy()));
        for k in [1, 3] {
            let r = req(prompt.clone(), SpecMode::Mtp, k, SamplingParams::greedy());
            let sp = run(&mut e, &r);
            assert_eq!(ar.text.as_bytes(), sp.text.as_bytes(), "{text:?} k={k}");
            assert_eq!(ar.token_ids, sp.token_ids, "{text:?} k={k}");
            assert_eq!(ar.logprobs, sp.logprobs, "{text:?} k={k}");
            accepted += sp.stats.spec.accepted;
            reqs.push((r, ar.clone()));
        }
    }
    assert!(accepted > 0, "the head drafts tokens the MoE target accepts");
    let batch: Vec<_> = reqs.iter().map(|(r, _)| r.clone()).collect();
    let outs = common::run_batch(&mut e, &batch, 2_000, "moe mtp batch");
    for (i, (o, (_, ar))) in outs.iter().zip(&reqs).enumerate() {
        common::same(ar, o, &format!("batched stream {i}"));
    }
}

/// `specula distill --target-layers` on an MTP head: a fused-feature head (EAGLE-3) trains on
/// the listed layers, says so in its config, loads and drafts exactly; a one-tap head given as
/// `--init` becomes its starting point (the deepest tap passed through); a fused head cannot
/// continue as a one-tap head.
#[test]
fn distill_trains_a_fused_feature_mtp_head() {
    use specula_engine::speculative::head::NamedTensors;
    let (dir, path, mut e) = tiny_with_path(Family::Llama);
    let layers = e.config().num_layers;
    let h = e.config().hidden_size;
    let taps = vec![0, layers - 1];
    let fused_opts = |out: &std::path::Path, steps: usize| specula_train::DistillOptions {
        target_layers: Some(taps.clone()),
        ..distill_opts(out, steps)
    };
    let fused = dir.path().join("fused");
    let r = specula_train::run_mtp(&mut e, &path, None, &fused_opts(&fused, 30), &mut |_| {}).expect("distill fused");
    assert!(r.finished && r.final_loss.is_finite(), "{r:?}");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fused.join("config.json")).expect("config")).expect("json");
    assert_eq!(cfg["target_layer_ids"], serde_json::json!(taps));
    let t = NamedTensors::read(&fused).expect("read head");
    let fc = format!("model.layers.{layers}.hidden_fc.weight");
    assert_eq!(t.map[&fc].dims(), &[h, 2 * h]);
    e.attach_mtp_head(&fused).expect("attach");
    assert_eq!(e.mtp_head().expect("head").taps, taps);
    for text in ["the then the thin the then", "in the thin then"] {
        let prompt = e.tokenize(text).expect("tokenize");
        let ar = run(&mut e, &req(prompt.clone(), SpecMode::Off, 1, SamplingParams::greedy()));
        let sp = run(&mut e, &req(prompt.clone(), SpecMode::Mtp, 3, SamplingParams::greedy()));
        assert!(sp.stats.spec.drafted > 0);
        assert_eq!(ar.text.as_bytes(), sp.text.as_bytes(), "{text:?}");
    }

    // A one-tap head as the start, at learning rate 0: every shared tensor is the start's, bit
    // for bit, and the projection passes the deepest tap through.
    let one = dir.path().join("one-tap");
    specula_train::run_mtp(&mut e, &path, None, &distill_opts(&one, 6), &mut |_| {}).expect("one-tap");
    let grown = dir.path().join("grown");
    let o = specula_train::DistillOptions {
        lr: 0.0,
        ..fused_opts(&grown, 2)
    };
    specula_train::run_mtp(&mut e, &path, Some(&one), &o, &mut |_| {}).expect("grow");
    let (a, b) = (
        NamedTensors::read(&one).expect("one"),
        NamedTensors::read(&grown).expect("grown"),
    );
    for (name, w) in &a.map {
        let (x, y) = (w.to_dtype(candle_core::DType::F32).expect("f32"), &b.map[name]);
        let y = y.to_dtype(candle_core::DType::F32).expect("f32");
        let diff = (x - y).expect("sub").abs().expect("abs").max_all().expect("max");
        assert_eq!(diff.to_scalar::<f32>().expect("scalar"), 0.0, "{name} changed");
    }
    let fc_w = b.map[&fc].to_dtype(candle_core::DType::F32).expect("f32");
    let deepest = fc_w.narrow(1, h, h).expect("narrow");
    let eye = candle_core::Tensor::eye(h, candle_core::DType::F32, &candle_core::Device::Cpu).expect("eye");
    let diff = (deepest - eye)
        .expect("sub")
        .abs()
        .expect("abs")
        .max_all()
        .expect("max");
    assert_eq!(diff.to_scalar::<f32>().expect("scalar"), 0.0);

    // A fused head continues on its own layers only.
    let other = specula_train::DistillOptions {
        target_layers: Some(vec![layers - 1]),
        ..distill_opts(&dir.path().join("other"), 2)
    };
    let err = specula_train::run_mtp(&mut e, &path, Some(&fused), &other, &mut |_| {}).expect_err("refused");
    assert!(format!("{err:#}").contains("reads target layers"), "{err:#}");
    // A fused head does not continue as a one-tap head.
    let back = dir.path().join("back");
    let err =
        specula_train::run_mtp(&mut e, &path, Some(&fused), &distill_opts(&back, 2), &mut |_| {}).expect_err("refused");
    assert!(format!("{err:#}").contains("--target-layers"), "{err:#}");
    // Bad layer lists fail before any work.
    for bad in [vec![], vec![1, 0], vec![0, layers]] {
        let o = specula_train::DistillOptions {
            target_layers: Some(bad.clone()),
            ..distill_opts(&back, 2)
        };
        let err = specula_train::run_mtp(&mut e, &path, None, &o, &mut |_| {}).expect_err("bad layers");
        assert!(format!("{err:#}").contains("--target-layers"), "{bad:?}: {err:#}");
    }
}

/// `specula distill` on a target attached to a device: the answers are decoded there and the
/// teacher pass reads the device's logits and last-block hidden states
/// ([`specula_engine::device::DeviceTarget::forward_hidden`]). Through [`CpuSlots`] (the CPU
/// model behind the device interface, 3 slots of at most 8 rows per forward) every stage must
/// give the CPU path's bits: the same teacher tensors and the same head, byte for byte.
#[test]
fn distill_through_a_device_target_matches_the_cpu_path() {
    let (dir, path, mut cpu) = tiny_with_path(Family::Llama);
    let model = std::sync::Arc::new(
        specula_engine::bundle::load(&path, &candle_core::Device::Cpu)
            .expect("load")
            .model,
    );
    let mut dev = Engine::load(&path, "tiny", LoadOptions::default()).expect("load");
    dev.attach_device(Box::new(CpuSlots::new(model, 3, 8)))
        .expect("attach device");
    let layers = cpu.config().num_layers;
    // A one-tap head, and a fused-feature head reading two blocks (each row's taps side by side).
    for fused in [None, Some(vec![0, layers - 1])] {
        let name = if fused.is_some() { "fused" } else { "one-tap" };
        let (a, b) = (
            dir.path().join(format!("cpu-{name}")),
            dir.path().join(format!("dev-{name}")),
        );
        let opts = |out: &std::path::Path| specula_train::DistillOptions {
            target_layers: fused.clone(),
            ..distill_opts(out, 12)
        };
        let ra = specula_train::run_mtp(&mut cpu, &path, None, &opts(&a), &mut |_| {}).expect("cpu");
        let mut notes = Vec::new();
        let rb = specula_train::run_mtp(&mut dev, &path, None, &opts(&b), &mut |p| {
            if let specula_train::Progress::Note(n) = p {
                notes.push(n)
            }
        })
        .expect("device");
        assert!(ra.finished && rb.finished);
        assert!(notes.iter().all(|n| !n.contains("runs on the CPU")), "{notes:?}");
        let read = |d: &std::path::Path| {
            candle_core::safetensors::load(d.join("data/teacher.safetensors"), &candle_core::Device::Cpu)
                .expect("teacher")
        };
        let (ta, tb) = (read(&a), read(&b));
        for tensor in ["tokens", "offsets", "answer_from", "hidden", "label_ids", "label_p"] {
            let bytes = |t: &std::collections::HashMap<String, candle_core::Tensor>| {
                let t = &t[tensor];
                (
                    t.dims().to_vec(),
                    t.flatten_all()
                        .expect("flat")
                        .to_dtype(candle_core::DType::F64)
                        .expect("f64")
                        .to_vec1::<f64>()
                        .expect("vec"),
                )
            };
            let (x, y) = (bytes(&ta), bytes(&tb));
            let first = x.1.iter().zip(&y.1).position(|(p, q)| p.to_bits() != q.to_bits());
            assert!(
                x.0 == y.0 && first.is_none(),
                "{name}: teacher tensor {tensor}: shapes {:?} {:?}, first difference at {first:?}",
                x.0,
                y.0
            );
        }
        assert!(ta["tokens"].dim(0).expect("dim") > 100);
        let width = fused.as_ref().map_or(1, Vec::len) * cpu.config().hidden_size;
        assert_eq!(ta["hidden"].dims()[1], width, "{name}");
        assert_eq!(
            std::fs::read(a.join("model.safetensors")).expect("cpu head"),
            std::fs::read(b.join("model.safetensors")).expect("device head"),
            "{name}: the head trained on the device's teacher pass is the CPU path's"
        );
    }
}

/// Training refuses, before any step, a head to start from that does not fit the target.
#[test]
fn distill_refuses_a_head_of_the_wrong_shape_before_training() {
    let (dir, path, mut e) = tiny_with_path(Family::Llama);
    let wide = {
        let p = dir.path().join("wide.gguf");
        write_tiny_gguf(
            &p,
            &TinySpec {
                hidden: 128,
                dtype: GgmlDType::Q8_0,
                ..TinySpec::new(Family::Llama)
            },
        )
        .expect("write");
        Engine::load(&p, "wide", LoadOptions::default()).expect("load")
    };
    let head = dir.path().join("wide-head");
    write_random_mtp_head(&head, wide.model(), MtpLayout::DeepseekV3, None, 1).expect("write");
    let out = dir.path().join("out");
    let mut stages = Vec::new();
    let err = specula_train::run_mtp(&mut e, &path, Some(&head), &distill_opts(&out, 5), &mut |p| {
        stages.push(format!("{p:?}"))
    })
    .expect_err("must be refused");
    let msg = format!("{err:#}");
    assert!(msg.contains("model.safetensors") && msg.contains("expected"), "{msg}");
    assert!(stages.is_empty(), "nothing ran before the error: {stages:?}");
}

/// `specula distill --kind block` on a tiny target: the trained block drafter loads, drafts
/// blocks the target partly accepts, and greedy output with it is byte-identical to AR.
#[test]
fn distilled_block_drafter_is_accepted_and_exact() {
    let (dir, path, mut e) = tiny_with_path(Family::Llama);
    let out = dir.path().join("block");
    let mut o = distill_opts(&out, 40);
    o.block_size = 4;
    o.target_layers = Some(vec![0, 1]);
    let r = specula_train::run(&mut e, &path, None, specula_train::HeadKind::Block, &o, &mut |_| {})
        .expect("distill block");
    assert!(r.finished && r.final_loss.is_finite(), "{r:?}");
    e.attach_block_drafter(&out).expect("attach");
    let mut accepted = 0;
    for text in ["the then the thin the then", "in the thin then", "then the"] {
        let prompt = e.tokenize(text).expect("tokenize");
        let ar = run(&mut e, &req(prompt.clone(), SpecMode::Off, 1, SamplingParams::greedy()));
        let sp = run(
            &mut e,
            &req(prompt.clone(), SpecMode::Block, 3, SamplingParams::greedy()),
        );
        assert_eq!(ar.text.as_bytes(), sp.text.as_bytes(), "{text:?}");
        assert_eq!(ar.token_ids, sp.token_ids, "{text:?}");
        accepted += sp.stats.spec.accepted;
    }
    assert!(accepted > 0, "a trained block drafter drafts tokens the target accepts");
}

/// `specula distill --self-prompts`: SmolLM2 writes its own user prompts (Magpie), cut from the
/// chat template at the start of a user turn. The same seed gives the same prompts; they are
/// plain user text (no chat markers), distinct, and most of them end within the token limit.
#[test]
fn smollm2_writes_its_own_training_prompts() {
    let path = common::model_path("smollm2-135m-instruct");
    let mut e = specula_engine::Engine::load(&path, "smollm2-135m-instruct", specula_engine::LoadOptions::default())
        .expect("model loads");
    let a = specula_train::data::self_prompts(&mut e, 6, 7, &mut |_| {}).expect("prompts");
    let b = specula_train::data::self_prompts(&mut e, 6, 7, &mut |_| {}).expect("prompts again");
    assert_eq!(a, b, "the same seed writes the same prompts");
    assert!(a.len() >= 4, "{a:?}");
    let distinct: std::collections::HashSet<&String> = a.iter().collect();
    assert_eq!(distinct.len(), a.len());
    for p in &a {
        assert!(
            !p.trim().is_empty() && !p.contains("<|im_") && !p.starts_with("user"),
            "{p:?}"
        );
    }
    // Another seed writes other prompts.
    let c = specula_train::data::self_prompts(&mut e, 6, 8, &mut |_| {}).expect("prompts");
    assert_ne!(a, c);
}
