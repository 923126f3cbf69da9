//! Mixture-of-Experts targets (Qwen3-MoE, Qwen2-MoE with its shared expert): the two bundle
//! layouts load to the same model, the expert dispatch is batch-invariant (row i of an m-row
//! forward is bitwise the one-row forward, every m up to 64), and greedy speculation on an MoE
//! target gives plain decoding's bytes solo, in batches of 1/4/16/32 and with a warm prefix
//! cache. Tiny random models written by `specula_engine::testing` (no fixtures, no downloads).

mod common;

use candle_core::quantized::GgmlDType;
use candle_core::Device;
use common::{run, same};
use specula_engine::arch::{self, qwen_moe::QwenMoe};
use specula_engine::bundle;
use specula_engine::model::{LogitsRows, Model};
use specula_engine::speculative::{SpecMode, SpecOptions};
use specula_engine::testing::{tiny_moe_config, write_random_gguf, write_random_hf, write_tiny_gguf, TinySpec};
use specula_engine::{Engine, GenerateOutput, GenerateRequest, LoadOptions, SamplingParams};

const FAMILIES: [&str; 2] = ["qwen3moe", "qwen2moe"];

/// A tiny MoE model of `family` written as GGUF in `dtype` (and as an HF bundle in f32) under
/// `dir`; returns the GGUF path and the HF directory.
fn write(dir: &std::path::Path, family: &'static str, dtype: GgmlDType) -> (std::path::PathBuf, std::path::PathBuf) {
    let c = tiny_moe_config(family);
    let gguf = dir.join(format!("{family}-{dtype:?}.gguf"));
    let hf = dir.join(format!("{family}-hf"));
    write_random_gguf(&gguf, &QwenMoe, family, &c, dtype, 11).expect("write gguf");
    write_random_hf(&hf, &QwenMoe, &c, 11).expect("write hf");
    (gguf, hf)
}

fn load(path: &std::path::Path) -> Model {
    bundle::load(path, &Device::Cpu).expect("load").model
}

fn logits_all(m: &Model, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut kv = m.new_kv_cache();
    let out = m.forward(tokens, &mut kv, LogitsRows::All, &[]).expect("forward");
    out.logits.to_vec2::<f32>().expect("logits")
}

fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 33) % vocab as u64) as u32
        })
        .collect()
}

#[test]
fn gguf_and_hf_bundles_of_the_same_weights_agree() {
    let dir = tempfile::tempdir().expect("tempdir");
    for family in FAMILIES {
        let (gguf, hf) = write(dir.path(), family, GgmlDType::F32);
        let (a, b) = (load(&gguf), load(&hf));
        let c = a.config();
        assert_eq!(c.moe, b.config().moe, "{family}: the two configs' experts");
        assert_eq!(c.moe.as_ref().expect("moe").layers, vec![true, true, false, true]);
        let plan = arch::of(c).layer_plan(c);
        let want = if family == "qwen2moe" {
            arch::MlpKind::MoeShared
        } else {
            arch::MlpKind::Moe
        };
        assert_eq!(plan[0].mlp, want, "{family}");
        assert_eq!(plan[2].mlp, arch::MlpKind::DenseSwiGlu, "{family}: the dense layer");
        let t = tokens(19, c.vocab_size, 3);
        let (la, lb) = (logits_all(&a, &t), logits_all(&b, &t));
        let mut worst = 0f32;
        for (ra, rb) in la.iter().zip(&lb) {
            for (x, y) in ra.iter().zip(rb) {
                worst = worst.max((x - y).abs());
            }
        }
        eprintln!("{family}: GGUF f32 vs HF f32, max |logit diff| {worst:e}");
        // Both run the same f32 weights; only the summation order of the products differs.
        assert!(worst < 1e-4, "{family}: GGUF and HF logits differ by {worst}");
    }
}

#[test]
fn expert_dispatch_is_batch_invariant_for_every_row_count_to_64() {
    let dir = tempfile::tempdir().expect("tempdir");
    for family in FAMILIES {
        for dtype in [GgmlDType::Q8_0, GgmlDType::Q4_0] {
            let (gguf, _) = write(dir.path(), family, dtype);
            let m = load(&gguf);
            assert!(
                m.batch_invariant(),
                "{family} {dtype:?} runs on batch-invariant kernels"
            );
            let vocab = m.config().vocab_size;
            let prefix = tokens(9, vocab, 5);
            let rows = tokens(64, vocab, 6);
            // One-row steps after the prefix: the reference rows.
            let mut kv = m.new_kv_cache();
            m.forward(&prefix, &mut kv, LogitsRows::None, &[]).expect("prefix");
            let one: Vec<Vec<u32>> = rows
                .iter()
                .map(|&t| {
                    let o = m.forward(&[t], &mut kv, LogitsRows::Last, &[]).expect("step");
                    let l = o.logits.to_vec2::<f32>().expect("logits").remove(0);
                    l.iter().map(|v| v.to_bits()).collect()
                })
                .collect();
            for n in 1..=64 {
                let mut kv = m.new_kv_cache();
                m.forward(&prefix, &mut kv, LogitsRows::None, &[]).expect("prefix");
                let o = m.forward(&rows[..n], &mut kv, LogitsRows::All, &[]).expect("rows");
                for (i, row) in o.logits.to_vec2::<f32>().expect("logits").iter().enumerate() {
                    let b: Vec<u32> = row.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(b, one[i], "{family} {dtype:?}: row {i} of {n}");
                }
            }
        }
    }
}

fn engine(path: &std::path::Path, prefix_cache: bool) -> Engine {
    let opts = LoadOptions {
        prefix_cache_bytes: if prefix_cache { 64 << 20 } else { 0 },
        ..LoadOptions::default()
    };
    Engine::load(path, "tiny-moe", opts).expect("load")
}

fn req(prompt: Vec<u32>, max_tokens: usize, spec: SpecOptions) -> GenerateRequest {
    GenerateRequest {
        prompt_tokens: prompt,
        sampling: SamplingParams::greedy(),
        max_tokens: Some(max_tokens),
        stop: vec![],
        logprobs: Some(2),
        ignore_eos: true,
        spec,
    }
}

fn spec(mode: SpecMode, k: usize, adaptive: bool) -> SpecOptions {
    SpecOptions {
        mode,
        draft_max: k,
        adaptive,
        ..SpecOptions::default()
    }
}

/// Prompts of the tiny vocabulary's ids (byte tokens and merges), some repetitive.
fn prompts(vocab: usize) -> Vec<Vec<u32>> {
    (0..8)
        .map(|i| {
            let base = tokens(6 + 3 * i, vocab - 2, 100 + i as u64);
            if i % 2 == 0 {
                base.iter().chain(&base).chain(&base).copied().collect()
            } else {
                base
            }
        })
        .collect()
}

#[test]
fn greedy_speculation_on_moe_targets_is_byte_identical_to_ar() {
    let dir = tempfile::tempdir().expect("tempdir");
    for family in FAMILIES {
        let (target, _) = write(dir.path(), family, GgmlDType::Q8_0);
        let draft = dir.path().join("draft.gguf");
        write_tiny_gguf(
            &draft,
            &TinySpec {
                dtype: GgmlDType::Q8_0,
                layers: 1,
                ..TinySpec::new(specula_engine::model::Family::Qwen3)
            },
        )
        .expect("draft");
        let mut e = engine(&target, false);
        e.attach_draft_model(&draft, "tiny-draft").expect("attach");
        let vocab = e.model().config().vocab_size;
        let (mut drafted, mut accepted) = (0, 0);
        for (i, p) in prompts(vocab).into_iter().enumerate() {
            let ar = run(&mut e, &req(p.clone(), 40, SpecOptions::default()));
            for (mode, k, adaptive) in [
                (SpecMode::Ngram, 4, false),
                (SpecMode::Ngram, 8, true),
                (SpecMode::Draft, 3, false),
                (SpecMode::Draft, 5, true),
            ] {
                let sp = run(&mut e, &req(p.clone(), 40, spec(mode, k, adaptive)));
                same(
                    &ar,
                    &sp,
                    &format!("{family} prompt {i} {mode:?} k={k} adaptive={adaptive}"),
                );
                drafted += sp.stats.spec.drafted;
                accepted += sp.stats.spec.accepted;
            }
        }
        eprintln!("{family}: drafted {drafted}, accepted {accepted}");
        assert!(accepted > 0, "{family}: speculation ran and kept drafts");
    }
}

#[test]
fn moe_batches_of_1_4_16_32_and_a_warm_prefix_cache_equal_solo_runs() {
    let dir = tempfile::tempdir().expect("tempdir");
    for family in FAMILIES {
        let (target, _) = write(dir.path(), family, GgmlDType::Q8_0);
        let mut e = engine(&target, false);
        let vocab = e.model().config().vocab_size;
        let ps = prompts(vocab);
        let reqs: Vec<GenerateRequest> = (0..32)
            .map(|i| {
                req(
                    ps[i % ps.len()].clone(),
                    16 + i % 5,
                    spec(SpecMode::Ngram, 2 + i % 4, i % 2 == 0),
                )
            })
            .collect();
        let solo: Vec<GenerateOutput> = reqs
            .iter()
            .map(|r| {
                let mut ar = r.clone();
                ar.spec = SpecOptions::default();
                run(&mut e, &ar)
            })
            .collect();
        for n in [1usize, 4, 16, 32] {
            let outs = common::run_batch(&mut e, &reqs[32 - n..], 2_000, &format!("{family} batch of {n}"));
            for (i, out) in outs.iter().enumerate() {
                same(&solo[32 - n + i], out, &format!("{family} batch of {n}, stream {i}"));
            }
        }
        let mut warm = engine(&target, true);
        for (i, r) in reqs.iter().take(8).enumerate() {
            // Twice: the second run starts from the prefix cache.
            for pass in 0..2 {
                let out = run(&mut warm, r);
                let mut ar = r.clone();
                ar.spec = SpecOptions::default();
                same(
                    &solo[i],
                    &out,
                    &format!("{family} warm cache, request {i}, pass {pass}"),
                );
            }
        }
    }
}

/// transformers 5's fused expert layout (`mlp.experts.gate_up_proj` `[experts, 2 × inter,
/// hidden]`, `mlp.experts.down_proj` `[experts, hidden, inter]`) loads to the same model as the
/// per-expert layout, and `inspect` reads it without errors.
#[test]
fn fused_expert_layout_loads_as_the_per_expert_one() {
    use candle_core::Tensor;
    let dir = tempfile::tempdir().expect("tempdir");
    let (_, hf) = write(dir.path(), "qwen3moe", GgmlDType::F32);
    let per_expert = load(&hf);
    let st = hf.join("model.safetensors");
    let mut w = candle_core::safetensors::load(&st, &Device::Cpu).expect("read");
    let c = tiny_moe_config("qwen3moe");
    let m = c.moe.clone().expect("moe");
    for l in (0..c.num_layers).filter(|&l| m.is_moe(l)) {
        let p = format!("model.layers.{l}.mlp.experts");
        let mut take = |proj: &str, e: usize| w.remove(&format!("{p}.{e}.{proj}.weight")).expect("expert");
        let (mut gate_up, mut down) = (Vec::new(), Vec::new());
        for e in 0..m.experts {
            let (g, u, d) = (take("gate_proj", e), take("up_proj", e), take("down_proj", e));
            gate_up.push(Tensor::cat(&[&g, &u], 0).expect("cat"));
            down.push(d);
        }
        w.insert(format!("{p}.gate_up_proj"), Tensor::stack(&gate_up, 0).expect("stack"));
        w.insert(format!("{p}.down_proj"), Tensor::stack(&down, 0).expect("stack"));
    }
    candle_core::safetensors::save(&w, &st).expect("save");
    let fused = load(&hf);
    let t = tokens(12, c.vocab_size, 9);
    assert_eq!(logits_all(&per_expert, &t), logits_all(&fused, &t), "the same model");
    let r = specula_engine::inspect::inspect(&hf, &Default::default()).expect("inspect");
    let errors: Vec<_> = r
        .diagnostics
        .iter()
        .filter(|d| d.severity == specula_engine::inspect::Severity::Error)
        .collect();
    assert!(errors.is_empty(), "inspect of the fused layout: {errors:?}");
}

/// `inspect` describes an MoE bundle: its experts, the active parameters per token, and a
/// missing expert as an error naming the tensor.
#[test]
fn inspect_describes_experts_and_names_a_missing_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    for family in FAMILIES {
        let (gguf, hf) = write(dir.path(), family, GgmlDType::Q8_0);
        for path in [&gguf, &hf] {
            let r = specula_engine::inspect::inspect(path, &Default::default()).expect("inspect");
            let text = r.to_string();
            let c = r.config.as_ref().expect("config");
            assert_eq!(c.moe, tiny_moe_config(family).moe, "{family} {}", path.display());
            assert!(
                text.contains("experts        8 per MoE layer (3 of 4 layers), 2 active per token, expert FFN 32"),
                "{text}"
            );
            assert!(text.contains("block parameters per token"), "{text}");
            let errors: Vec<_> = r
                .diagnostics
                .iter()
                .filter(|d| d.severity == specula_engine::inspect::Severity::Error)
                .collect();
            assert!(errors.is_empty(), "{family} {}: {errors:?}", path.display());
        }
        // Active parameters: attention + router + 2 of 8 experts (+ the shared expert).
        let c = tiny_moe_config(family);
        let attention = 2 * 64 * 64 + 2 * 64 * 32;
        let shared = if family == "qwen2moe" { 3 * 64 * 64 + 64 } else { 0 };
        let moe_layer = |k: usize| attention + 8 * 64 + k * 3 * 64 * 32 + shared;
        assert_eq!(c.block_params(), 3 * moe_layer(2) + attention + 3 * 64 * 128);
        assert_eq!(c.total_block_params(), 3 * moe_layer(8) + attention + 3 * 64 * 128);
        // An HF bundle without one expert's tensor: inspect names it, the load names it.
        let st = hf.join("model.safetensors");
        let mut w = candle_core::safetensors::load(&st, &Device::Cpu).expect("read");
        let gone = "model.layers.3.mlp.experts.5.up_proj.weight";
        w.remove(gone).expect("present");
        candle_core::safetensors::save(&w, &st).expect("save");
        let r = specula_engine::inspect::inspect(&hf, &Default::default()).expect("inspect");
        assert!(
            r.diagnostics
                .iter()
                .any(|d| d.severity == specula_engine::inspect::Severity::Error && d.to_string().contains(gone)),
            "{family}: {:?}",
            r.diagnostics
        );
        let Err(err) = bundle::load(&hf, &Device::Cpu) else {
            panic!("{family}: a bundle without an expert loaded")
        };
        let err = format!("{err:#}");
        assert!(err.contains(gone), "{family}: {err}");
    }
}

/// A fixture's reference outputs (`tests/fixtures/<name>/reference.json`, written by
/// `scripts/moe_tiny_fixture.py`): per sequence its tokens and every position's logits, from
/// transformers (f32) and, for the GGUF fixtures, llama.cpp on the committed Q8_0 file.
fn reference(name: &str) -> serde_json::Value {
    let p = common::repo_root()
        .join("tests/fixtures")
        .join(name)
        .join("reference.json");
    serde_json::from_str(&std::fs::read_to_string(&p).expect("reference.json")).expect("json")
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// The largest |difference| between the logits `ours` gives for a sequence's tokens and
/// `sequences` (every position of each), and whether every position's argmax agrees.
fn compare(ours: &mut dyn FnMut(&[u32]) -> Vec<Vec<f32>>, sequences: &serde_json::Value) -> (f32, bool) {
    let (mut worst, mut argmax_ok) = (0f32, true);
    for s in sequences.as_array().expect("sequences") {
        let ours = ours(&ids(&s["tokens"]));
        for (row, want) in ours.iter().zip(s["logits"].as_array().expect("logits")) {
            let want: Vec<f32> = want
                .as_array()
                .expect("row")
                .iter()
                .map(|x| x.as_f64().expect("logit") as f32)
                .collect();
            for (a, b) in row.iter().zip(&want) {
                worst = worst.max((a - b).abs());
            }

            let top = |r: &[f32]| (0..r.len()).max_by(|&i, &j| r[i].total_cmp(&r[j])).expect("row");
            argmax_ok &= top(row) == top(&want);
        }
    }
    (worst, argmax_ok)
}

/// Greedy tokens after `prompt`, as the engine generates them.
fn greedy(path: &std::path::Path, prompt: Vec<u32>, n: usize) -> Vec<u32> {
    let mut e = Engine::load(path, "fixture", LoadOptions::default()).expect("load");
    run(&mut e, &req(prompt, n, SpecOptions::default())).token_ids
}

/// The HF fixtures (Qwen3-MoE, Qwen2-MoE with a shared expert, and a Qwen3-MoE with a dense
/// layer in transformers 5's fused expert layout) against transformers' f32 logits. Bound 1e-2,
/// as for Gemma: our forward stores K and V rounded to f16 (the cache, llama.cpp's default
/// type), transformers keeps f32, so attention outputs move by ~2^-11 of their size and logits
/// of magnitude ~5 by a few 1e-3 (measured: 1.8e-3 at most; llama.cpp on an f32 GGUF of the
/// same weights with its f16 cache: 2.6e-3). A wrong routing rule moves them by 0.1 or more.
/// The argmax and the greedy tokens must agree (smallest top-1/top-2 margin: 4e-3).
#[test]
fn hf_fixtures_match_transformers() {
    for name in ["qwen3moe-tiny", "qwen2moe-tiny", "qwen3moe-tiny-mixed"] {
        let dir = common::repo_root().join("tests/fixtures").join(name);
        let r = reference(name);
        let m = load(&dir);
        if name.ends_with("mixed") {
            let moe = m.config().moe.clone().expect("moe");
            assert_eq!((moe.layers, moe.norm_topk_prob), (vec![true, false, true], false));
        }
        let (worst, argmax_ok) = compare(&mut |t| logits_all(&m, t), &r["sequences"]);
        eprintln!("{name}: HF vs transformers, max |logit diff| {worst:e}");
        assert!(worst < 1e-2, "{name}: logits differ from transformers' by {worst}");
        assert!(argmax_ok, "{name}: an argmax differs from transformers'");
        let g = &r["greedy"];
        let n = g["generated"].as_array().expect("generated").len();
        assert_eq!(
            greedy(&dir, ids(&g["prompt"]), n),
            ids(&g["generated"]),
            "{name}: greedy"
        );
    }
}

/// The GGUF fixtures (the same weights, Q8_0 as llama.cpp's converter writes them) against
/// llama.cpp's logits on the same file (its default settings: f16 cache, flash attention), and
/// its greedy tokens. In the reference mode that reproduces llama.cpp's arithmetic
/// (`Engine::logits_as_llamacpp`: ggml's dot products, its attention) the logits agree to the
/// reference's 6 significant digits (bound 2e-5: |logit| < 20); the serving path, whose
/// products sum in another order, is within llama.cpp's own distance from transformers' f32
/// logits (0.12: the activations are quantized to Q8_0 in every product).
#[test]
fn gguf_fixtures_match_llamacpp() {
    for name in ["qwen3moe-tiny", "qwen2moe-tiny"] {
        let path = common::repo_root()
            .join("tests/fixtures")
            .join(name)
            .join("model-q8_0.gguf");
        let r = reference(name);
        let m = load(&path);
        assert!(m.batch_invariant());
        let mut e = Engine::load(&path, "fixture", LoadOptions::default()).expect("load");
        let mut as_llamacpp = |t: &[u32]| {
            let l = e.logits_as_llamacpp(t, t.len()).expect("logits");
            l.to_vec2::<f32>().expect("logits")
        };
        let (worst, argmax_ok) = compare(&mut as_llamacpp, &r["llamacpp"]["sequences"]);
        let (vs_tf, _) = compare(&mut |t| logits_all(&m, t), &r["sequences"]);
        eprintln!("{name}: GGUF Q8_0 vs llama.cpp max |logit diff| {worst:e}; vs transformers {vs_tf:e}");
        assert!(worst < 2e-5, "{name}: logits differ from llama.cpp's by {worst}");
        assert!(argmax_ok, "{name}: an argmax differs from llama.cpp's");
        assert!(vs_tf < 0.12, "{name}: {vs_tf} from transformers");
        // llama.cpp's greedy run (the prompt in one batch, then one token per step), teacher
        // forced through the reference mode: each generated token is the argmax there.
        let g = &r["llamacpp"]["greedy"];
        let (prompt, generated) = (ids(&g["prompt"]), ids(&g["generated"]));
        let all: Vec<u32> = prompt.iter().chain(&generated).copied().collect();
        let l = e
            .logits_as_llamacpp(&all[..all.len() - 1], prompt.len())
            .expect("logits")
            .to_vec2::<f32>()
            .expect("logits");
        let top = |r: &[f32]| (0..r.len()).max_by(|&i, &j| r[i].total_cmp(&r[j])).expect("row") as u32;
        let ours: Vec<u32> = l[prompt.len() - 1..].iter().map(|r| top(r)).collect();
        assert_eq!(ours, generated, "{name}: llama.cpp's greedy tokens");
    }
}

/// The shape of the synthetic MoE model for CPU speed measurements (a few hundred MB in Q8_0):
/// Qwen3-MoE, hidden 1024, 6 layers, 16 query / 4 KV heads of 64, 64 experts of 256, 8 per token.
fn bench_config() -> specula_engine::model::ModelConfig {
    let mut c = tiny_moe_config("qwen3moe");
    c.hidden_size = 1024;
    c.intermediate_size = 2048;
    c.num_layers = 6;
    c.num_heads = 16;
    c.num_kv_heads = 4;
    c.head_dim = 64;
    c.context_length = 4096;
    c.rope_theta = 1e6;
    c.moe = Some(arch::MoeConfig {
        experts: 64,
        experts_per_token: 8,
        expert_intermediate_size: 256,
        shared_intermediate_size: None,
        norm_topk_prob: true,
        layers: vec![true; 6],
    });
    c
}

/// Write the synthetic MoE GGUF for the CPU speed comparison with llama.cpp (docs/perf.md):
/// `SPECULA_MOE_BENCH_OUT=/tmp/moe-bench.gguf cargo test --release -p specula-engine --test moe
/// -- --ignored write_bench_moe`.
#[test]
#[ignore]
fn write_bench_moe() {
    let out = std::env::var("SPECULA_MOE_BENCH_OUT").unwrap_or_else(|_| "/tmp/moe-bench.gguf".into());
    write_random_gguf(
        std::path::Path::new(&out),
        &QwenMoe,
        "qwen3moe",
        &bench_config(),
        GgmlDType::Q8_0,
        5,
    )
    .expect("write");
    eprintln!("wrote {out}");
}

/// Verify cost by rows on an MoE target: the seconds of an r-row forward after a 512-token
/// prefill over a one-row decode (median of 7), r = 2..9, beside the controller's prior
/// (`verify_cost_prior`). `SPECULA_MOE_BENCH_OUT` names the model (default: the synthetic one
/// of `write_bench_moe`): `cargo test --release -p specula-engine --test moe -- --ignored
/// moe_verify_cost --nocapture`.
#[test]
#[ignore]
fn moe_verify_cost() {
    use std::time::Instant;
    let path = std::env::var("SPECULA_MOE_BENCH_OUT").unwrap_or_else(|_| "/tmp/moe-bench.gguf".into());
    let model = load(std::path::Path::new(&path));
    let c = model.config().clone();
    let ids = tokens(512 + 9, c.vocab_size, 17);
    let mut kv = model.new_kv_cache();
    model
        .forward(&ids[..512], &mut kv, LogitsRows::None, &[])
        .expect("prefill");
    let mut time = |n: usize| {
        let mut t: Vec<f64> = (0..7)
            .map(|_| {
                let s = Instant::now();
                let rows = if n == 1 { LogitsRows::Last } else { LogitsRows::All };
                model.forward(&ids[512..512 + n], &mut kv, rows, &[]).expect("forward");
                kv.truncate(512);
                s.elapsed().as_secs_f64()
            })
            .collect();
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    };
    let one = time(1);
    let mut line = format!("1 row {:.2} ms", one * 1e3);
    for r in 2..=9 {
        let t = time(r);
        let prior = specula_engine::speculative::controller::verify_cost_prior(&c, r);
        line += &format!(" | {r}: {:.2}x (prior {prior:.2}x)", t / one);
    }
    eprintln!("{path}: {line}");
}

/// Malformed MoE configs are refused by the loader and by `inspect`, the error naming the key
/// or field: expert counts no bundle can hold (none, billions, more per token than there are),
/// a Qwen2-MoE without its shared expert, non-boolean / non-positive routing fields, a dense
/// layer past the last one, a fused expert tensor of an impossible shape. No enumeration of
/// absent tensors, no panic.
#[test]
fn malformed_moe_configs_name_the_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    let refused = |path: &std::path::Path, key: &str| {
        let Err(e) = bundle::load(path, &Device::Cpu) else {
            panic!("{}: loaded despite a bad '{key}'", path.display())
        };
        let e = format!("{e:#}");
        assert!(
            e.contains(key),
            "{}: the error does not name '{key}': {e}",
            path.display()
        );
        let r = specula_engine::inspect::inspect(path, &Default::default()).expect("inspect");
        let errors: Vec<String> = r
            .diagnostics
            .iter()
            .filter(|d| d.severity == specula_engine::inspect::Severity::Error)
            .map(|d| d.to_string())
            .collect();
        assert!(
            errors.iter().any(|d| d.contains(key)),
            "{}: inspect does not name '{key}': {errors:?}",
            path.display()
        );
        assert!(errors.len() < 60, "{}: {} errors listed", path.display(), errors.len());
    };
    // GGUF: the counts as written by the architecture's metadata writer.
    for (key, v) in [
        ("qwen3moe.expert_used_count", 9u32),
        ("qwen3moe.expert_used_count", 0),
        ("qwen3moe.expert_count", 1 << 31),
    ] {
        let p = dir.path().join(format!("{key}-{v}.gguf"));
        // The tensors of a valid config, one metadata value changed.
        write_random_gguf(
            &p,
            &QwenMoe,
            "qwen3moe",
            &tiny_moe_config("qwen3moe"),
            GgmlDType::Q8_0,
            1,
        )
        .expect("write");
        rewrite_gguf_u32(&p, key, v);
        refused(&p, key);
    }
    // HF: config.json edits.
    let cases: Vec<(&str, &str, serde_json::Value, &str)> = vec![
        ("qwen3moe", "num_experts_per_tok", 9.into(), "num_experts_per_tok"),
        ("qwen3moe", "num_experts", (1u64 << 31).into(), "num_experts"),
        ("qwen3moe", "num_experts", 0.into(), "num_experts"),
        (
            "qwen2moe",
            "shared_expert_intermediate_size",
            0.into(),
            "shared_expert_intermediate_size",
        ),
        ("qwen3moe", "norm_topk_prob", "yes".into(), "norm_topk_prob"),
        ("qwen3moe", "decoder_sparse_step", 0.into(), "decoder_sparse_step"),
        ("qwen3moe", "decoder_sparse_step", "2".into(), "decoder_sparse_step"),
        ("qwen3moe", "mlp_only_layers", serde_json::json!([7]), "mlp_only_layers"),
    ];
    for (i, (family, field, value, key)) in cases.into_iter().enumerate() {
        let hf = dir.path().join(format!("hf-{i}"));
        write_random_hf(&hf, &QwenMoe, &tiny_moe_config(family), 1).expect("write");
        let cfg = hf.join("config.json");
        let mut j: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&cfg).expect("read")).expect("json");
        j[field] = value;
        std::fs::write(&cfg, j.to_string()).expect("write");
        refused(&hf, key);
    }
    // A fused gate/up tensor whose rows cannot be split into gate and up halves.
    let hf = dir.path().join("hf-odd");
    write_random_hf(&hf, &QwenMoe, &tiny_moe_config("qwen3moe"), 1).expect("write");
    let st = hf.join("model.safetensors");
    let mut w = candle_core::safetensors::load(&st, &Device::Cpu).expect("read");
    w.insert(
        "model.layers.0.mlp.experts.gate_up_proj".into(),
        candle_core::Tensor::zeros((8, 63, 64), candle_core::DType::F32, &Device::Cpu).expect("zeros"),
    );
    candle_core::safetensors::save(&w, &st).expect("save");
    refused(&hf, "model.layers.0.mlp.experts.gate_up_proj");
}

/// Rewrite one u32 metadata value of the GGUF file at `path` in place.
fn rewrite_gguf_u32(path: &std::path::Path, key: &str, v: u32) {
    use candle_core::quantized::gguf_file;
    let mut f = std::fs::File::open(path).expect("open");
    let content = gguf_file::Content::read(&mut f).expect("read");
    let mut md = content.metadata.clone();
    md.insert(key.to_string(), gguf_file::Value::U32(v));
    let tensors: Vec<(String, candle_core::quantized::QTensor)> = content
        .tensor_infos
        .keys()
        .map(|n| (n.clone(), content.tensor(&mut f, n, &Device::Cpu).expect("tensor")))
        .collect();
    let md_refs: Vec<(&str, &gguf_file::Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &candle_core::quantized::QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut out = std::fs::File::create(path).expect("create");
    gguf_file::write(&mut out, &md_refs, &t_refs).expect("write");
}
