//! The architecture seam holds: a toy architecture with a layer kind the dense block does not
//! have (attention and MLP in parallel from one norm, as GPT-J and Falcon build their blocks)
//! and tensor names of its own is added by this one file and the registry alone. It loads from
//! a GGUF file and an HF bundle the test writes, computes what an independent reference
//! implementation of the same block computes, speculates exactly (n-gram lookup and a draft
//! model of the same architecture), and shows in `inspect`.

use std::collections::HashMap;

use anyhow::{anyhow, Result};
use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::GgmlDType;
use candle_core::{Device, Tensor};
use serde_json::Value as Json;
use specula_engine::arch::shape::{down_proj, hidden, kv_proj, o_proj, q_proj, up_proj, vocab_by_hidden};
use specula_engine::arch::{
    self, llama, Architecture, AttentionKind, BundleFormat, Kind, LayerPlan, MlpKind, Role, StateKind, TensorSpec,
    WeightSource,
};
use specula_engine::model::{Block, Family, LayerPass, LogitsRows, Mlp, Model, ModelConfig, RopeStyle};
use specula_engine::speculative::{SampledVerify, SpecMode, SpecOptions};
use specula_engine::testing::{tiny_vocab, write_random_gguf, write_random_hf};
use specula_engine::{Engine, GenerateRequest, LoadOptions, SamplingParams};

/// The toy's registered name (GGUF `general.architecture` and HF `model_type`).
const NAME: &str = "toyparallel";

#[derive(Debug)]
struct Parallel;

/// A row of the toy's schema: every tensor required but the (untied) LM head.
const fn t(
    role: Role,
    gguf: &'static str,
    hf: &'static str,
    per_layer: bool,
    kind: Kind,
    shape: fn(&ModelConfig) -> Vec<usize>,
) -> TensorSpec {
    TensorSpec::new(role, gguf, hf, per_layer, !matches!(role, Role::Output), kind, shape)
}

/// Names of its own in both formats; one norm per layer.
static TENSORS: &[TensorSpec] = &[
    t(
        Role::TokenEmbedding,
        "tok.weight",
        "transformer.wte.weight",
        false,
        Kind::Table,
        vocab_by_hidden,
    ),
    t(Role::AttnNorm, "ln.weight", "ln_1.weight", true, Kind::Vector, hidden),
    t(Role::AttnQ, "wq.weight", "attn.q.weight", true, Kind::Matrix, q_proj),
    t(Role::AttnK, "wk.weight", "attn.k.weight", true, Kind::Matrix, kv_proj),
    t(Role::AttnV, "wv.weight", "attn.v.weight", true, Kind::Matrix, kv_proj),
    t(
        Role::AttnOutput,
        "wo.weight",
        "attn.out.weight",
        true,
        Kind::Matrix,
        o_proj,
    ),
    t(
        Role::FfnGate,
        "w1.weight",
        "mlp.fc_gate.weight",
        true,
        Kind::Matrix,
        up_proj,
    ),
    t(
        Role::FfnUp,
        "w3.weight",
        "mlp.fc_in.weight",
        true,
        Kind::Matrix,
        up_proj,
    ),
    t(
        Role::FfnDown,
        "w2.weight",
        "mlp.fc_out.weight",
        true,
        Kind::Matrix,
        down_proj,
    ),
    t(
        Role::OutputNorm,
        "ln_f.weight",
        "transformer.ln_f.weight",
        false,
        Kind::Vector,
        hidden,
    ),
    t(
        Role::Output,
        "head.weight",
        "transformer.head.weight",
        false,
        Kind::Matrix,
        vocab_by_hidden,
    ),
];

fn name(role: Role, f: BundleFormat, layer: usize) -> String {
    arch::spec(TENSORS, role).name(f, layer)
}

impl Architecture for Parallel {
    fn name(&self) -> &'static str {
        NAME
    }
    fn gguf_names(&self) -> &'static [&'static str] {
        &[NAME]
    }
    fn hf_model_types(&self) -> &'static [&'static str] {
        &[NAME]
    }
    fn gguf_required_keys(&self) -> &'static [&'static str] {
        llama::Llama.gguf_required_keys()
    }
    fn hf_required_fields(&self) -> &'static [&'static str] {
        llama::Llama.hf_required_fields()
    }
    fn config_from_gguf(
        &self,
        arch: &str,
        md: &HashMap<String, Value>,
        dims: &dyn Fn(&str) -> Option<Vec<usize>>,
    ) -> Result<ModelConfig> {
        let embd = name(Role::TokenEmbedding, BundleFormat::Gguf, 0);
        llama::dense_config_from_gguf(arch, Family::Other(NAME), RopeStyle::Neox, md, &embd, dims)
    }
    fn config_from_hf(&self, _model_type: &str, c: &Json) -> Result<ModelConfig> {
        llama::dense_config_from_hf(Family::Other(NAME), c)
    }
    fn tensors(&self) -> &'static [TensorSpec] {
        TENSORS
    }
    fn layer_plan(&self, c: &ModelConfig) -> Vec<LayerPlan> {
        let plan = LayerPlan {
            attention: AttentionKind::Full,
            mlp: MlpKind::DenseSwiGlu,
            qkv_bias: false,
            qk_norm: false,
            parallel: true,
            post_norms: false,
        };
        vec![plan; c.num_layers]
    }
    fn state_kind(&self) -> StateKind {
        StateKind::KvRows
    }
    fn build(&self, config: ModelConfig, w: &mut dyn WeightSource, device: &Device) -> Result<Model> {
        let f = w.format();
        let embd = w.table(&name(Role::TokenEmbedding, f, 0))?;
        let mut blocks = Vec::new();
        for l in 0..config.num_layers {
            let mut lin = |r: Role| w.linear(&name(r, f, l), None);
            let (q, k, v, o) = (
                lin(Role::AttnQ)?,
                lin(Role::AttnK)?,
                lin(Role::AttnV)?,
                lin(Role::AttnOutput)?,
            );
            let (gate, up, down) = (lin(Role::FfnGate)?, lin(Role::FfnUp)?, lin(Role::FfnDown)?);
            blocks.push(Block {
                attn_norm: w.dense(&name(Role::AttnNorm, f, l))?,
                q,
                k,
                v,
                o,
                q_norm: None,
                k_norm: None,
                ffn_norm: None,
                mlp: Mlp::dense(gate, up, down),
                post_attn_norm: None,
                post_ffn_norm: None,
            });
        }
        let norm = w.dense(&name(Role::OutputNorm, f, 0))?;
        let head = w.table(&name(Role::Output, f, 0))?.to_linear()?;
        Model::new(config, embd, blocks, norm, head, None, device.clone())
    }
    /// `x += attn(norm(x)) + mlp(norm(x))`, one norm for both.
    fn layer_forward(&self, layer: &mut LayerPass<'_, '_, '_>, x: &mut [f32]) -> Result<()> {
        let h = layer.attn_norm(x);
        let a = layer.attention(&h)?;
        let m = layer.mlp(&h)?;
        for ((x, a), m) in x.iter_mut().zip(&a).zip(&m) {
            *x += a + m;
        }
        Ok(())
    }
    fn gguf_metadata(&self, c: &ModelConfig) -> Vec<(String, Value)> {
        llama::dense_gguf_metadata(NAME, c)
    }
    fn hf_config(&self, c: &ModelConfig) -> Json {
        llama::dense_hf_config(NAME, c)
    }
}

static TOY: Parallel = Parallel;

fn config() -> ModelConfig {
    ModelConfig {
        family: Family::Other(NAME),
        vocab_size: tiny_vocab().0.len(),
        hidden_size: 64,
        intermediate_size: 96,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        rms_norm_eps: 1e-6,
        rope_theta: 10_000.0,
        context_length: 256,
        rope_style: RopeStyle::Neox,
        sliding_window: None,
        query_scale: None,
        rope_freq_scale: None,
        moe: None,
    }
}

/// The toy registered, and its bundles written with the same weights: (dir, GGUF f32, GGUF
/// Q8_0, HF).
fn bundles() -> (
    tempfile::TempDir,
    std::path::PathBuf,
    std::path::PathBuf,
    std::path::PathBuf,
) {
    arch::register(&TOY).expect("register");
    let dir = tempfile::tempdir().expect("tempdir");
    let (f32_path, q8_path, hf) = (
        dir.path().join("toy-f32.gguf"),
        dir.path().join("toy-q8.gguf"),
        dir.path().join("toy-hf"),
    );
    let c = config();
    write_random_gguf(&f32_path, &TOY, NAME, &c, GgmlDType::F32, 7).expect("gguf f32");
    write_random_gguf(&q8_path, &TOY, NAME, &c, GgmlDType::Q8_0, 7).expect("gguf q8");
    write_random_hf(&hf, &TOY, &c, 7).expect("hf");
    (dir, f32_path, q8_path, hf)
}

/// The toy's logits for `tokens`, every row, computed from the HF weights by a plain f64
/// implementation of the block written from its definition (no Specula code): RMSNorm, RoPE
/// over halves, causal grouped-query attention, SwiGLU, parallel residual.
fn reference_logits(hf: &std::path::Path, tokens: &[u32]) -> Result<Vec<Vec<f64>>> {
    let w = candle_core::safetensors::load(hf.join("model.safetensors"), &Device::Cpu)?;
    let get = |n: String| -> Result<Vec<Vec<f64>>> {
        let t = w.get(&n).ok_or_else(|| anyhow!("missing {n}"))?;
        let t: &Tensor = t;
        let rows = if t.rank() == 1 { t.unsqueeze(0)? } else { t.clone() };
        Ok(rows
            .to_vec2::<f32>()?
            .into_iter()
            .map(|r| r.into_iter().map(f64::from).collect())
            .collect())
    };
    let c = config();
    let (h, d, nh, nkv) = (c.hidden_size, c.head_dim, c.num_heads, c.num_kv_heads);
    let hf_name = |r: Role, l: usize| name(r, BundleFormat::Hf, l);
    let matvec = |m: &[Vec<f64>], x: &[f64]| -> Vec<f64> {
        m.iter()
            .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
            .collect()
    };
    let rms = |x: &[f64], w: &[f64]| -> Vec<f64> {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        let s = 1.0 / (ms + c.rms_norm_eps).sqrt();
        x.iter().zip(w).map(|(v, w)| v * s * w).collect()
    };
    let rope = |x: &mut [f64], pos: usize| {
        for head in x.chunks_mut(d) {
            for i in 0..d / 2 {
                let theta = pos as f64 * c.rope_theta.powf(-2.0 * i as f64 / d as f64);
                let (a, b) = (head[i], head[i + d / 2]);
                head[i] = a * theta.cos() - b * theta.sin();
                head[i + d / 2] = a * theta.sin() + b * theta.cos();
            }
        }
    };
    let embd = get(hf_name(Role::TokenEmbedding, 0))?;
    let mut xs: Vec<Vec<f64>> = tokens.iter().map(|&t| embd[t as usize].clone()).collect();
    for l in 0..c.num_layers {
        let norm = get(hf_name(Role::AttnNorm, l))?.remove(0);
        let (wq, wk, wv, wo) = (
            get(hf_name(Role::AttnQ, l))?,
            get(hf_name(Role::AttnK, l))?,
            get(hf_name(Role::AttnV, l))?,
            get(hf_name(Role::AttnOutput, l))?,
        );
        let (wg, wu, wd) = (
            get(hf_name(Role::FfnGate, l))?,
            get(hf_name(Role::FfnUp, l))?,
            get(hf_name(Role::FfnDown, l))?,
        );
        let hs: Vec<Vec<f64>> = xs.iter().map(|x| rms(x, &norm)).collect();
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (p, hrow) in hs.iter().enumerate() {
            let (mut q, mut k) = (matvec(&wq, hrow), matvec(&wk, hrow));
            rope(&mut q, p);
            rope(&mut k, p);
            qs.push(q);
            ks.push(k);
            vs.push(matvec(&wv, hrow));
        }
        for (p, x) in xs.iter_mut().enumerate() {
            let mut att = vec![0.0; nh * d];
            for head in 0..nh {
                let g = head / (nh / nkv);
                let qh = &qs[p][head * d..(head + 1) * d];
                let scores: Vec<f64> = (0..=p)
                    .map(|j| {
                        qh.iter()
                            .zip(&ks[j][g * d..(g + 1) * d])
                            .map(|(a, b)| a * b)
                            .sum::<f64>()
                            / (d as f64).sqrt()
                    })
                    .collect();
                let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
                let z: f64 = e.iter().sum();
                for (j, ej) in e.iter().enumerate() {
                    for i in 0..d {
                        att[head * d + i] += ej / z * vs[j][g * d + i];
                    }
                }
            }
            let a = matvec(&wo, &att);
            let (g, u) = (matvec(&wg, &hs[p]), matvec(&wu, &hs[p]));
            let act: Vec<f64> = g.iter().zip(&u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
            let m = matvec(&wd, &act);
            for i in 0..h {
                x[i] += a[i] + m[i];
            }
        }
    }
    let fnorm = get(hf_name(Role::OutputNorm, 0))?.remove(0);
    let head = get(hf_name(Role::Output, 0))?;
    Ok(xs.iter().map(|x| matvec(&head, &rms(x, &fnorm))).collect())
}

fn model_logits(path: &std::path::Path, tokens: &[u32]) -> Vec<Vec<f32>> {
    let b = specula_engine::bundle::load(path, &Device::Cpu).expect("load");
    let mut kv = b.model.new_kv_cache();
    let out = b.model.forward(tokens, &mut kv, LogitsRows::All, &[]).expect("forward");
    out.logits.to_vec2::<f32>().expect("logits")
}

const PROMPT: [u32; 12] = [17, 200, 33, 90, 91, 17, 200, 33, 5, 250, 17, 200];

#[test]
fn toy_architecture_loads_from_both_formats_and_matches_a_reference() {
    let (_dir, gguf, _q8, hf) = bundles();
    let want = reference_logits(&hf, &PROMPT).expect("reference");
    let scale = want.iter().flatten().fold(0f64, |a, v| a.max(v.abs()));
    assert!(scale > 1.0, "the reference logits are not trivial ({scale})");
    for path in [&gguf, &hf] {
        let got = model_logits(path, &PROMPT);
        assert_eq!(got.len(), PROMPT.len());
        let mut worst = 0f64;
        for (g, w) in got.iter().zip(&want) {
            for (g, w) in g.iter().zip(w) {
                worst = worst.max((f64::from(*g) - w).abs());
            }
        }
        // The KV cache keeps keys and values in f16 (llama.cpp's default), so agreement is
        // to about 1e-3 of the logits' scale.
        assert!(
            worst < 2e-3 * scale,
            "{}: max |logit - reference| {worst} (scale {scale})",
            path.display()
        );
    }
}

#[test]
fn toy_architecture_speculates_exactly() {
    let (_dir, _f32, q8, _hf) = bundles();
    let mut e = Engine::load(&q8, "toy", LoadOptions::default()).expect("load");
    e.attach_draft_model(&q8, "toy-draft")
        .expect("attach a draft model of the same architecture");
    let req = |spec: SpecOptions| GenerateRequest {
        prompt_tokens: PROMPT.to_vec(),
        sampling: SamplingParams::greedy(),
        max_tokens: Some(48),
        stop: Vec::new(),
        logprobs: None,
        ignore_eos: true,
        spec,
    };
    let run = |e: &mut Engine, r: &GenerateRequest| e.generate(r, &mut |_| true).expect("generate");
    let ar = run(&mut e, &req(SpecOptions::default()));
    assert_eq!(ar.token_ids.len(), 48);
    for mode in [SpecMode::Ngram, SpecMode::Draft] {
        let sp = run(
            &mut e,
            &req(SpecOptions {
                mode,
                draft_max: 4,
                adaptive: false,
                sampled_verify: SampledVerify::Coupled,
            }),
        );
        assert_eq!(ar.token_ids, sp.token_ids, "{mode:?}: token ids");
        assert_eq!(ar.text.as_bytes(), sp.text.as_bytes(), "{mode:?}: text");
        assert!(
            sp.stats.spec.drafted > 0,
            "{mode:?}: nothing was drafted ({:?})",
            sp.stats.spec
        );
        if mode == SpecMode::Draft {
            // The draft model is the target itself: every draft is accepted.
            assert_eq!(
                sp.stats.spec.accepted,
                sp.stats.spec.drafted.min(48),
                "{:?}",
                sp.stats.spec
            );
        }
    }
}

#[test]
fn toy_architecture_shows_in_inspect() {
    let (_dir, _f32, q8, hf) = bundles();
    for path in [&q8, &hf] {
        let r = specula_engine::inspect::inspect(path, &Default::default()).expect("inspect");
        let errors: Vec<_> = r.errors().collect();
        assert!(errors.is_empty(), "{}: {errors:?}", path.display());
        assert_eq!(r.architecture.as_deref(), Some(NAME));
        assert_eq!(r.family, Some(Family::Other(NAME)));
        let text = r.to_string();
        assert!(text.contains(&format!("(family {NAME})")), "{text}");
        assert!(text.contains("parallel"), "the layer plan is shown: {text}");
        let c = r.config.as_ref().expect("config");
        assert_eq!((c.hidden_size, c.num_layers, c.intermediate_size), (64, 2, 96));
    }
    let r = specula_engine::inspect::inspect(&q8, &Default::default()).expect("inspect");
    let k = r.kernels.as_ref().expect("kernel report");
    assert!(k.batch_invariant, "{}", k.reason);
    // 7 projections per layer and the LM head, by the toy's own names.
    assert!(k.reason.contains("all 15 projections"), "{}", k.reason);
}

#[test]
fn a_name_cannot_be_registered_twice() {
    #[derive(Debug)]
    struct Clash;
    impl Architecture for Clash {
        fn name(&self) -> &'static str {
            "clash"
        }
        fn gguf_names(&self) -> &'static [&'static str] {
            &["qwen2"]
        }
        fn hf_model_types(&self) -> &'static [&'static str] {
            &[]
        }
        fn gguf_required_keys(&self) -> &'static [&'static str] {
            &[]
        }
        fn hf_required_fields(&self) -> &'static [&'static str] {
            &[]
        }
        fn config_from_gguf(
            &self,
            _: &str,
            _: &HashMap<String, Value>,
            _: &dyn Fn(&str) -> Option<Vec<usize>>,
        ) -> Result<ModelConfig> {
            unreachable!()
        }
        fn config_from_hf(&self, _: &str, _: &Json) -> Result<ModelConfig> {
            unreachable!()
        }
        fn tensors(&self) -> &'static [TensorSpec] {
            &[]
        }
        fn layer_plan(&self, _: &ModelConfig) -> Vec<LayerPlan> {
            Vec::new()
        }
        fn state_kind(&self) -> StateKind {
            StateKind::KvRows
        }
        fn build(&self, _: ModelConfig, _: &mut dyn WeightSource, _: &Device) -> Result<Model> {
            unreachable!()
        }
        fn gguf_metadata(&self, _: &ModelConfig) -> Vec<(String, Value)> {
            Vec::new()
        }
        fn hf_config(&self, _: &ModelConfig) -> Json {
            Json::Null
        }
    }
    static CLASH: Clash = Clash;
    let err = arch::register(&CLASH).expect_err("qwen2 is taken");
    assert!(err.to_string().contains("'qwen2' is already registered"), "{err}");
}
