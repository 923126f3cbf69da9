//! The engine's device path (`Engine::attach_device`: KV in per-sequence slots, rollback by
//! position, logits rows selected per segment) against the engine's own CPU path, byte for
//! byte, with the CPU model behind the device interface ([`CpuSlots`]). The CUDA model runs the
//! same engine code on the H200 (docs/gpu.md).

use candle_core::quantized::GgmlDType;
use candle_core::Device;
use specula_engine::device::{run_segments, CpuSlots, DeviceSegment, DeviceTarget, RowOut};
use specula_engine::model::{Family, LogitsRows};
use specula_engine::sampling::argmax;
use specula_engine::speculative::mtp::MtpLayout;
use specula_engine::speculative::{SampledVerify, SpecMode, SpecOptions};
use specula_engine::testing::{write_tiny_gguf, TinySpec};
use specula_engine::{bundle, Engine, GenerateOutput, GenerateRequest, LoadOptions, SamplingParams};
use std::path::Path;
use std::sync::Arc;

fn write(dir: &Path, name: &str, spec: TinySpec) -> std::path::PathBuf {
    let path = dir.join(name);
    write_tiny_gguf(&path, &spec).expect("write");
    path
}

fn base() -> TinySpec {
    TinySpec {
        dtype: GgmlDType::Q8_0,
        ..TinySpec::new(Family::Qwen2)
    }
}

/// A plain engine and one whose target runs through `CpuSlots` with `slots` slots and at most
/// `max_rows` rows per forward (small, so long segments are split).
fn pair(dir: &Path, slots: usize, max_rows: usize) -> (Engine, Engine) {
    let target = write(dir, "target.gguf", base());
    let draft = write(
        dir,
        "draft.gguf",
        TinySpec {
            seed: 7,
            layers: 1,
            dtype: GgmlDType::Q4_0,
            ..base()
        },
    );
    // A prefix-cache budget turns the device's slot reuse on.
    let opts = || LoadOptions {
        prefill_chunk: 16,
        prefix_cache_bytes: 1 << 20,
        ..LoadOptions::default()
    };
    let mut plain = Engine::load(&target, "tiny", opts()).expect("load");
    plain.attach_draft_model(&draft, "tiny-draft").expect("attach");
    let mut dev = Engine::load(&target, "tiny", opts()).expect("load");
    dev.attach_draft_model(&draft, "tiny-draft").expect("attach");
    let model = Arc::new(bundle::load(&target, &Device::Cpu).expect("load").model);
    dev.attach_device(Box::new(CpuSlots::new(model, slots, max_rows)))
        .expect("attach device");
    (plain, dev)
}

/// A request; greedy ones without logprobs take the device's argmax-only rows.
fn req(e: &Engine, text: &str, max_tokens: usize, mode: SpecMode, sampling: SamplingParams) -> GenerateRequest {
    let logprobs = (!sampling.is_greedy() || max_tokens % 2 == 1).then_some(2);
    GenerateRequest {
        prompt_tokens: e.tokenize(text).expect("tokenize"),
        sampling,
        max_tokens: Some(max_tokens),
        stop: vec![],
        logprobs,
        ignore_eos: true,
        spec: SpecOptions {
            mode,
            draft_max: 4,
            adaptive: false,
            sampled_verify: Default::default(),
        },
    }
}

fn same(a: &GenerateOutput, b: &GenerateOutput, what: &str) {
    assert_eq!(a.text.as_bytes(), b.text.as_bytes(), "{what}: text");
    assert_eq!(a.token_ids, b.token_ids, "{what}: token ids");
    assert_eq!(a.logprobs, b.logprobs, "{what}: logprobs");
    assert_eq!(a.finish_reason, b.finish_reason, "{what}: finish reason");
    assert_eq!(a.stats.completion_tokens, b.stats.completion_tokens, "{what}: usage");
}

fn sampled(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.8,
        top_p: 0.95,
        seed: Some(seed),
        ..SamplingParams::greedy()
    }
}

#[test]
fn device_path_equals_the_cpu_path_for_ar_and_every_drafter() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut plain, mut dev) = pair(dir.path(), 2, 5);
    assert_eq!(dev.device_name(), Some("cpu (slots)"));
    let prompt = "the then the thin the then the thin the then, and a longer prompt past one chunk";
    let mut seeded_ar = None;
    for mode in [SpecMode::Off, SpecMode::Ngram, SpecMode::Draft] {
        for (what, sampling, n, verify) in [
            (
                "greedy, argmax rows",
                SamplingParams::greedy(),
                60,
                SampledVerify::Coupled,
            ),
            (
                "greedy, logits rows",
                SamplingParams::greedy(),
                61,
                SampledVerify::Coupled,
            ),
            ("sampled, coupled", sampled(11), 60, SampledVerify::Coupled),
            ("sampled, rejection", sampled(11), 60, SampledVerify::Rejection),
        ] {
            let mut r = req(&plain, prompt, n, mode, sampling);
            r.spec.sampled_verify = verify;
            let a = plain.generate(&r, &mut |_| true).expect("plain");
            let b = dev.generate(&r, &mut |_| true).expect("device");
            same(&a, &b, &format!("{mode:?} {what}"));
            assert_eq!(a.stats.spec.decode_path, b.stats.spec.decode_path);
            if what == "sampled, coupled" {
                // A seeded request verified by coupling is the seed's plain output.
                match &seeded_ar {
                    None => seeded_ar = Some(b.clone()),
                    Some(ar) => same(ar, &b, &format!("{mode:?} coupled against plain")),
                }
            }
            if mode == SpecMode::Draft {
                // Other weights draft: some rows are rejected and rolled back by position.
                assert!(b.stats.spec.drafted > 0, "{what}: drafted");
                assert!(b.stats.spec.accepted < b.stats.spec.drafted, "{what}: some rejected");
            }
        }
    }
    // Every slot went back.
    assert_eq!(dev.device_slots().map(|s| s.in_use()), Some(0));
}

#[test]
fn concurrent_device_sequences_equal_their_solo_runs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut plain, mut dev) = pair(dir.path(), 4, 7);
    let reqs = [
        req(
            &plain,
            "the then the thin the then",
            40,
            SpecMode::Ngram,
            SamplingParams::greedy(),
        ),
        req(
            &plain,
            "a b c a b c a b c a b",
            33,
            SpecMode::Off,
            SamplingParams::greedy(),
        ),
        req(
            &plain,
            "hello there, hello there, hello",
            45,
            SpecMode::Draft,
            sampled(3),
        ),
        req(
            &plain,
            "one two three four five six seven eight nine ten",
            29,
            SpecMode::Draft,
            SamplingParams::greedy(),
        ),
    ];
    let solo: Vec<GenerateOutput> = reqs
        .iter()
        .map(|r| plain.generate(r, &mut |_| true).expect("solo"))
        .collect();
    let mut seqs: Vec<_> = reqs
        .iter()
        .map(|r| dev.start_sequence(r, None).expect("start"))
        .collect();
    let slots: Vec<_> = seqs.iter().map(|s| s.device_slot()).collect();
    assert_eq!(slots, vec![Some(0), Some(1), Some(2), Some(3)]);
    // A fifth sequence finds no slot: a clear error, nothing leaks.
    let Err(err) = dev.start_sequence(&reqs[0], None) else {
        panic!("a fifth sequence got a slot");
    };
    assert!(err.to_string().contains("KV slots"), "{err}");
    let mut steps = 0;
    while seqs.iter().any(|s| s.finished().is_none()) {
        let mut refs: Vec<_> = seqs.iter_mut().collect();
        for r in dev.step(&mut refs) {
            r.expect("step");
        }
        steps += 1;
        assert!(steps < 400, "no progress");
    }
    for (i, s) in seqs.into_iter().enumerate() {
        let out = dev.retire(s, true);
        same(&solo[i], &out, &format!("sequence {i}"));
    }
    assert_eq!(dev.device_slots().map(|s| s.in_use()), Some(0));
    // A freed slot serves the next request.
    let again = dev.generate(&reqs[1], &mut |_| true).expect("again");
    same(&solo[1], &again, "after the batch");
}

#[test]
fn device_segments_split_at_the_row_limit_and_select_logits_rows() {
    let dir = tempfile::tempdir().expect("tempdir");
    let target = write(dir.path(), "target.gguf", base());
    let model = Arc::new(bundle::load(&target, &Device::Cpu).expect("load").model);
    let tokens: Vec<u32> = (0..13).map(|i| 97 + i * 3 % 26).collect();
    // Reference: all 13 rows through the CPU model at once.
    let mut kv = model.new_kv_cache();
    let all: Vec<Vec<f32>> = model
        .forward(&tokens, &mut kv, LogitsRows::All, &[])
        .expect("forward")
        .logits
        .to_vec2()
        .expect("logits");
    let mut t = CpuSlots::new(model.clone(), 2, 4);
    let segs = [
        DeviceSegment {
            tokens: &tokens[..9],
            slot: 1,
            start: 0,
            rows: LogitsRows::None,
            argmax_only: false,
        },
        DeviceSegment {
            tokens: &tokens[..3],
            slot: 0,
            start: 0,
            rows: LogitsRows::Last,
            argmax_only: false,
        },
    ];
    let out = run_segments(&mut t, &segs).expect("run");
    assert_eq!(out[0].len(), 0);
    assert_eq!(out[1], vec![RowOut::Logits(all[2].clone())]);
    let rest = |argmax_only| {
        [DeviceSegment {
            tokens: &tokens[9..],
            slot: 1,
            start: 9,
            rows: LogitsRows::All,
            argmax_only,
        }]
    };
    let out = run_segments(&mut t, &rest(false)).expect("run");
    let want: Vec<RowOut> = all[9..].iter().map(|r| RowOut::Logits(r.clone())).collect();
    assert_eq!(out[0], want);
    // The same rows again (rolled back by position), argmax only.
    let out = run_segments(&mut t, &rest(true)).expect("run");
    let want: Vec<RowOut> = all[9..].iter().map(|r| RowOut::Argmax(argmax(r))).collect();
    assert_eq!(out[0], want);
    // Out-of-range slots and positions past what a slot holds are errors, not panics.
    let bad = [DeviceSegment {
        tokens: &tokens[..1],
        slot: 5,
        start: 0,
        rows: LogitsRows::Last,
        argmax_only: false,
    }];
    assert!(run_segments(&mut t, &bad).is_err());
    let gap = [DeviceSegment {
        tokens: &tokens[..1],
        slot: 0,
        start: 7,
        rows: LogitsRows::Last,
        argmax_only: false,
    }];
    assert!(run_segments(&mut t, &gap).is_err());
    assert_eq!(t.max_rows(), 4);
}

#[test]
fn drafters_with_taps_are_refused_on_a_device() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_plain, mut dev) = pair(dir.path(), 1, 8);
    let head = dir.path().join("head");
    specula_engine::testing::write_random_mtp_head(&head, dev.model(), MtpLayout::DeepseekV3, None, 3).expect("head");
    let err = dev.attach_mtp_head(&head).expect_err("refused");
    assert!(err.to_string().contains("hidden states"), "{err}");
}

#[test]
fn a_freed_slot_serves_its_prefix_to_the_next_request_exactly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut plain, mut dev) = pair(dir.path(), 2, 6);
    let turn1 = "the then the thin the then, a first turn of a conversation";
    let first = req(&plain, turn1, 20, SpecMode::Ngram, SamplingParams::greedy());
    let out1 = dev.generate(&first, &mut |_| true).expect("turn 1");
    assert_eq!(out1.stats.cached_prompt_tokens, 0);
    // The same prompt again: every position but the last comes from the slot.
    let again = dev.generate(&first, &mut |_| true).expect("again");
    assert_eq!(again.stats.cached_prompt_tokens, first.prompt_tokens.len() - 1);
    same(
        &plain.generate(&first, &mut |_| true).expect("plain"),
        &again,
        "same prompt",
    );
    // A second turn: turn 1's prompt and answer, then more text (the slot holds the prompt and
    // all of the answer but its last token).
    let mut next = first.clone();
    next.prompt_tokens.extend_from_slice(&out1.token_ids);
    next.prompt_tokens
        .extend(dev.tokenize(" and then a follow-up question").expect("tokenize"));
    let out2 = dev.generate(&next, &mut |_| true).expect("turn 2");
    assert_eq!(
        out2.stats.cached_prompt_tokens,
        first.prompt_tokens.len() + out1.token_ids.len() - 1
    );
    same(
        &plain.generate(&next, &mut |_| true).expect("plain"),
        &out2,
        "second turn",
    );
    // Another prompt while the warm slot is free takes the cold slot and shares nothing.
    let other = req(
        &plain,
        "one two three four",
        12,
        SpecMode::Off,
        SamplingParams::greedy(),
    );
    let o = dev.generate(&other, &mut |_| true).expect("other");
    assert_eq!(o.stats.cached_prompt_tokens, 0);
    same(
        &plain.generate(&other, &mut |_| true).expect("plain"),
        &o,
        "other prompt",
    );
    let stats = dev.prefix_cache_stats().expect("stats");
    assert_eq!((stats.hits, stats.misses), (2, 2));
    // A request cancelled by its client retires without an error: its slot keeps what it
    // committed, and the next run of the same prompt reuses it, still exactly.
    let mut n = 0;
    let cancelled = dev
        .generate(&next, &mut |_| {
            n += 1;
            n < 3
        })
        .expect("cancelled");
    assert_eq!(cancelled.finish_reason, specula_engine::FinishReason::Cancelled);
    let after = dev.generate(&next, &mut |_| true).expect("after a cancel");
    assert!(after.stats.cached_prompt_tokens > 0);
    same(&out2, &after, "after a cancel");
}

#[test]
fn slot_choice_keeps_a_conversation_warm_and_reuse_follows_the_prefix_cache_switch() {
    use specula_engine::device::SlotPool;
    let pool = SlotPool::new(2, true);
    let conversation: Vec<u32> = (0..40).collect();
    let (a, n) = pool.lease(&conversation).expect("slot");
    assert_eq!((a.slot(), n), (0, 0));
    pool.remember(a.slot(), conversation.clone());
    drop(a);
    // Another request sharing only a short header takes the empty slot, not the warm one.
    let mut other: Vec<u32> = (0..4).collect();
    other.extend(100..120);
    let (b, n) = pool.lease(&other).expect("slot");
    assert_eq!((b.slot(), n), (1, 0));
    // The conversation's next turn finds its slot.
    let mut next = conversation.clone();
    next.extend(200..210);
    let (c, n) = pool.lease(&next).expect("slot");
    assert_eq!((c.slot(), n), (0, 40));
    assert!(pool.lease(&next).is_none(), "both slots are held");
    // The same prompt again finds it too, though the slot holds a long answer after it and
    // the other slot is empty.
    let mut answered = next.clone();
    answered.extend(300..400);
    pool.remember(c.slot(), answered);
    drop((b, c));
    let (c, n) = pool.lease(&next).expect("slot");
    assert_eq!((c.slot(), n), (0, next.len() - 1));
    drop(c);
    // With reuse off, nothing is remembered or reused.
    let off = SlotPool::new(1, false);
    let (d, _) = off.lease(&conversation).expect("slot");
    off.remember(d.slot(), conversation.clone());
    drop(d);
    assert_eq!(off.lease(&conversation).map(|(_, n)| n), Some(0));
}

#[test]
fn a_device_without_batch_invariant_kernels_does_not_speculate_or_reuse() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = write(
        dir.path(),
        "f16.gguf",
        TinySpec {
            dtype: GgmlDType::F16,
            ..TinySpec::new(Family::Qwen2)
        },
    );
    let opts = LoadOptions {
        prefix_cache_bytes: 1 << 20,
        ..LoadOptions::default()
    };
    let mut e = Engine::load(&path, "tiny", opts).expect("load");
    let model = Arc::new(bundle::load(&path, &Device::Cpu).expect("load").model);
    assert!(!model.batch_invariant());
    e.attach_device(Box::new(CpuSlots::new(model, 1, 8))).expect("attach");
    assert!(!e.batch_invariant());
    let r = req(
        &e,
        "the then the thin the then",
        20,
        SpecMode::Ngram,
        SamplingParams::greedy(),
    );
    let first = e.generate(&r, &mut |_| true).expect("first");
    assert!(
        first.stats.spec.decode_path.starts_with("ar"),
        "{}",
        first.stats.spec.decode_path
    );
    let again = e.generate(&r, &mut |_| true).expect("again");
    assert_eq!(again.stats.cached_prompt_tokens, 0);
    same(&first, &again, "repeat");
}
