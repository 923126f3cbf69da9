//! Tiny random models for tests of shapes and plumbing: written as real GGUF files and HF bundle
//! directories, so tests go through the same loaders as real models.

use std::collections::HashMap;
use std::path::Path;

use anyhow::Result;
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use crate::arch::{llama, Architecture, BundleFormat, Kind, Role};
use crate::model::{Family, ModelConfig};

/// Shape of a tiny test model.
#[derive(Debug, Clone)]
pub struct TinySpec {
    pub family: Family,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub context: usize,
    /// Tensor type for the projection weights in the GGUF file.
    pub dtype: GgmlDType,
    pub seed: u64,
}

impl TinySpec {
    pub fn new(family: Family) -> Self {
        Self {
            family,
            hidden: 64,
            intermediate: 128,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            context: 256,
            dtype: GgmlDType::F32,
            seed: 1,
        }
    }

    /// A tiny model whose projections are of type `dtype`. The K-quants (Q2_K..Q6_K) pack 256
    /// weights per super-block along the input dimension, so for them every input width
    /// (hidden, intermediate, heads × head_dim) is a multiple of 256: hidden 256, intermediate
    /// 512, 4 heads of 64 (2 KV heads).
    pub fn with_dtype(family: Family, dtype: GgmlDType) -> Self {
        let base = Self {
            dtype,
            ..Self::new(family)
        };
        if dtype.block_size() < 256 {
            return base;
        }
        Self {
            hidden: 256,
            intermediate: 512,
            head_dim: 64,
            ..base
        }
    }
}

pub use crate::tokenizer::bytes_to_unicode;

/// The tiny vocabulary: 256 byte tokens, a few merges, then `<|im_start|>` and `<|im_end|>`.
pub fn tiny_vocab() -> (Vec<String>, Vec<String>, Vec<i32>) {
    let table = bytes_to_unicode();
    let mut tokens: Vec<String> = table.iter().map(|c| c.to_string()).collect();
    let mut types = vec![1i32; 256];
    let sp = table[b' ' as usize];
    let merges: Vec<String> = vec![format!("{sp} t"), "h e".into(), format!("{sp}t h"), "i n".into()];
    tokens.extend([format!("{sp}t"), "he".into(), format!("{sp}th"), "in".into()]);
    types.extend([1, 1, 1, 1]);
    tokens.extend(["<|im_start|>".to_string(), "<|im_end|>".to_string()]);
    types.extend([3, 3]);
    (tokens, merges, types)
}

const TINY_TEMPLATE: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// The config a [`TinySpec`] describes.
fn tiny_config(spec: &TinySpec, vocab: usize) -> ModelConfig {
    ModelConfig {
        family: spec.family,
        vocab_size: vocab,
        hidden_size: spec.hidden,
        intermediate_size: spec.intermediate,
        num_layers: spec.layers,
        num_heads: spec.heads,
        num_kv_heads: spec.kv_heads,
        head_dim: spec.head_dim,
        rms_norm_eps: 1e-6,
        rope_theta: 10_000.0,
        context_length: spec.context,
        rope_style: crate::model::RopeStyle::Neox,
        sliding_window: None,
        query_scale: None,
        rope_freq_scale: None,
        moe: None,
    }
}

/// A tiny Mixture-of-Experts config over the tiny vocabulary ([`tiny_vocab`]): Qwen3-MoE
/// (`qwen3moe`: QK-norm, top-k renormalized) or Qwen2-MoE (`qwen2moe`: q/k/v biases, a shared
/// expert of 64); hidden 64, 4 layers (layer 2 dense of 128, the others 8 experts of 32, 2 per
/// token), 4 heads of 16 over 2 KV heads, 256 positions.
pub fn tiny_moe_config(gguf_arch: &'static str) -> ModelConfig {
    let qwen2 = gguf_arch == "qwen2moe";
    ModelConfig {
        family: Family::Other(gguf_arch),
        vocab_size: tiny_vocab().0.len(),
        hidden_size: 64,
        intermediate_size: 128,
        num_layers: 4,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        rms_norm_eps: 1e-6,
        rope_theta: 10_000.0,
        context_length: 256,
        rope_style: crate::model::RopeStyle::Neox,
        sliding_window: None,
        query_scale: None,
        rope_freq_scale: None,
        moe: Some(crate::arch::MoeConfig {
            experts: 8,
            experts_per_token: 2,
            expert_intermediate_size: 32,
            shared_intermediate_size: qwen2.then_some(64),
            norm_topk_prob: !qwen2,
            layers: vec![true, true, false, true],
        }),
    }
}

/// A random tensor for `role` of shape `shape`: norms `1 + U(-0.1, 0.1)` (the output norm
/// exactly 1), biases `U(-0.1, 0.1)`, the embedding `U(-1, 1)`, the LM head `U(-0.5, 0.5)`,
/// projections `U(-0.3, 0.3)`.
fn random_for(u: &mut Uniform, role: Role, shape: &[usize]) -> Result<Tensor> {
    match role {
        Role::AttnNorm | Role::FfnNorm | Role::AttnQNorm | Role::AttnKNorm => u.norm(shape[0], 0.1),
        Role::OutputNorm => Ok(Tensor::ones(shape, candle_core::DType::F32, &Device::Cpu)?),
        Role::AttnQBias | Role::AttnKBias | Role::AttnVBias => u.tensor(shape, 0.1),
        Role::TokenEmbedding => u.tensor(shape, 1.0),
        Role::Output => u.tensor(shape, 0.5),
        _ => u.tensor(shape, 0.3),
    }
}

/// Whether a tensor of `role` is written for a model of `family` (each member's optional
/// tensors: Qwen2's biases, Qwen3's QK-norm; the RoPE factors never).
fn tiny_has(family: Family, role: Role) -> bool {
    match role {
        Role::AttnQBias | Role::AttnKBias | Role::AttnVBias => family == Family::Qwen2,
        Role::AttnQNorm | Role::AttnKNorm => family == Family::Qwen3,
        Role::RopeFreqs => false,
        _ => true,
    }
}

/// Deterministic random weights (uniform, [`random_for`]'s scales), named as HF names them
/// (the architecture's schema), in the schema's order, with their roles. Shapes are HF's
/// (`[out, in]`).
fn tiny_weights(spec: &TinySpec, vocab: usize) -> Result<Vec<(String, Role, Tensor)>> {
    let mut u = Uniform::new(spec.seed);
    let c = tiny_config(spec, vocab);
    let mut w = Vec::new();
    for e in crate::arch::expected_tensors(&llama::Llama, &c, BundleFormat::Hf) {
        if tiny_has(spec.family, e.spec.role) {
            w.push((
                e.name,
                e.spec.role,
                random_for(&mut u, e.spec.role, &(e.spec.shape)(&c))?,
            ));
        }
    }
    Ok(w)
}

/// Random weights for every tensor of `arch`'s schema that a bundle of config `c` must hold
/// (the required ones, and an untied LM head), named in `format`, in the schema's order;
/// values by role as [`random_for`] draws them.
fn random_bundle_weights(
    arch: &dyn Architecture,
    c: &ModelConfig,
    format: BundleFormat,
    seed: u64,
) -> Result<Vec<(String, Kind, Tensor)>> {
    let mut u = Uniform::new(seed);
    let mut w = Vec::new();
    for e in crate::arch::expected_tensors(arch, c, format) {
        if e.required || e.spec.role == Role::Output {
            w.push((
                e.name,
                e.spec.kind,
                random_for(&mut u, e.spec.role, &(e.spec.shape)(c))?,
            ));
        }
    }
    Ok(w)
}

/// Write a random-weight GGUF file of architecture `arch` (its `general.architecture` is
/// `gguf_arch`) with config `c` (its `vocab_size` must be the tiny vocabulary's, [`tiny_vocab`]):
/// the metadata from [`Architecture::gguf_metadata`], matrices in `dtype`, vectors in f32, the
/// tiny tokenizer. Weights are those [`write_random_hf`] writes with the same seed.
pub fn write_random_gguf(
    path: &Path,
    arch: &dyn Architecture,
    gguf_arch: &str,
    c: &ModelConfig,
    dtype: GgmlDType,
    seed: u64,
) -> Result<()> {
    use gguf_file::Value as V;
    let mut qtensors: Vec<(String, QTensor)> = Vec::new();
    for (name, kind, t) in random_bundle_weights(arch, c, BundleFormat::Gguf, seed)? {
        // Matrices and tables (stacked experts too) in `dtype`; what the loader reads as f32
        // (norms, biases, an MoE router, as llama.cpp's converter keeps it) in f32.
        let dt = if kind == Kind::Vector { GgmlDType::F32 } else { dtype };
        qtensors.push((name, QTensor::quantize(&t, dt)?));
    }
    let mut md: Vec<(String, V)> = vec![
        ("general.architecture".into(), V::String(gguf_arch.into())),
        ("general.name".into(), V::String(format!("tiny-{gguf_arch}"))),
    ];
    md.extend(arch.gguf_metadata(c));
    md.extend(tiny_tokenizer_metadata(TINY_TEMPLATE));
    let md_refs: Vec<(&str, &V)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = qtensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path)?;
    gguf_file::write(&mut f, &md_refs, &t_refs)?;
    Ok(())
}

/// Write a random-weight HF bundle of architecture `arch` with config `c` into `dir`:
/// `config.json` from [`Architecture::hf_config`], f32 safetensors, the tiny tokenizer.
pub fn write_random_hf(dir: &Path, arch: &dyn Architecture, c: &ModelConfig, seed: u64) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let map: HashMap<String, Tensor> = random_bundle_weights(arch, c, BundleFormat::Hf, seed)?
        .into_iter()
        .map(|(n, _, t)| (n, t))
        .collect();
    candle_core::safetensors::save(&map, dir.join("model.safetensors"))?;
    let mut config = arch.hf_config(c);
    config["torch_dtype"] = "float32".into();
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config)?)?;
    write_tiny_hf_tokenizer(dir)
}

/// Reorder the rows of a q/k projection from HF's half-split RoPE layout to the interleaved
/// layout GGUF Llama files use (llama.cpp's `convert_hf_to_gguf.py` permute).
fn permute_for_interleaved(w: &Tensor, heads: usize) -> Result<Tensor> {
    let dims = w.dims().to_vec();
    let out = dims[0];
    let d = out / heads;
    let rest: Vec<usize> = dims[1..].to_vec();
    let mut shape = vec![heads, 2, d / 2];
    shape.extend(&rest);
    let t = w.reshape(shape)?.transpose(1, 2)?.contiguous()?;
    Ok(t.reshape(dims)?)
}

/// Write a tiny random model as a GGUF file.
pub fn write_tiny_gguf(path: &Path, spec: &TinySpec) -> Result<()> {
    write_tiny_gguf_with_template(path, spec, TINY_TEMPLATE)
}

/// As [`write_tiny_gguf`], with `template` as the GGUF's `tokenizer.chat_template` (e.g. one
/// that opens `<think>` in the generation prompt).
pub fn write_tiny_gguf_with_template(path: &Path, spec: &TinySpec, template: &str) -> Result<()> {
    let tokens = tiny_vocab().0;
    let weights = tiny_weights(spec, tokens.len())?;
    let arch = spec.family.as_str();
    let mut qtensors: Vec<(String, QTensor)> = Vec::new();
    for (name, role, t) in &weights {
        // llama.cpp's converter permutes Llama's q and k rows for adjacent-pair RoPE.
        let t = match role {
            Role::AttnQ if spec.family == Family::Llama => permute_for_interleaved(t, spec.heads)?,
            Role::AttnK if spec.family == Family::Llama => permute_for_interleaved(t, spec.kv_heads)?,
            _ => t.clone(),
        };
        let is_matrix = t.rank() == 2;
        let dtype = if is_matrix { spec.dtype } else { GgmlDType::F32 };
        let gguf = crate::arch::rename(llama::TENSORS, name, BundleFormat::Hf, BundleFormat::Gguf)
            .ok_or_else(|| anyhow::anyhow!("{name} has no GGUF name"))?;
        qtensors.push((gguf, QTensor::quantize(&t, dtype)?));
    }
    use gguf_file::Value as V;
    let mut md: Vec<(String, V)> = vec![
        ("general.architecture".into(), V::String(arch.into())),
        ("general.name".into(), V::String(format!("tiny-{arch}"))),
    ];
    let config = tiny_config(spec, tokens.len());
    md.extend(crate::arch::of(&config).gguf_metadata(&config));
    md.extend(tiny_tokenizer_metadata(template));
    let md_refs: Vec<(&str, &V)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = qtensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = std::fs::File::create(path)?;
    gguf_file::write(&mut f, &md_refs, &t_refs)?;
    Ok(())
}

/// The tiny vocabulary's GGUF tokenizer metadata (byte-level BPE, EOS the last token), with
/// `template` as the chat template.
fn tiny_tokenizer_metadata(template: &str) -> Vec<(String, gguf_file::Value)> {
    use gguf_file::Value as V;
    let (tokens, merges, types) = tiny_vocab();
    vec![
        ("tokenizer.ggml.model".into(), V::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), V::String("qwen2".into())),
        (
            "tokenizer.ggml.tokens".into(),
            V::Array(tokens.iter().map(|t| V::String(t.clone())).collect()),
        ),
        (
            "tokenizer.ggml.merges".into(),
            V::Array(merges.iter().map(|t| V::String(t.clone())).collect()),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            V::Array(types.iter().map(|&t| V::I32(t)).collect()),
        ),
        ("tokenizer.ggml.eos_token_id".into(), V::U32(tokens.len() as u32 - 1)),
        ("tokenizer.chat_template".into(), V::String(template.into())),
    ]
}

/// Write the same tiny random model as a Hugging Face bundle directory (f32 safetensors,
/// tokenizer.json built from the same vocabulary, ChatML template).
pub fn write_tiny_hf(dir: &Path, spec: &TinySpec) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let tokens = tiny_vocab().0;
    let weights = tiny_weights(spec, tokens.len())?;
    let map: HashMap<String, Tensor> = weights.into_iter().map(|(n, _, t)| (n, t)).collect();
    candle_core::safetensors::save(&map, dir.join("model.safetensors"))?;
    let c = tiny_config(spec, tokens.len());
    let mut config = crate::arch::of(&c).hf_config(&c);
    config["tie_word_embeddings"] = false.into();
    config["torch_dtype"] = "float32".into();
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config)?)?;
    write_tiny_hf_tokenizer(dir)
}

/// The tiny vocabulary as `tokenizer.json` and `tokenizer_config.json` (EOS `<|im_end|>`,
/// ChatML template) in `dir`.
fn write_tiny_hf_tokenizer(dir: &Path) -> Result<()> {
    let (tokens, merges, types) = tiny_vocab();
    let mut md = HashMap::new();
    use gguf_file::Value as V;
    md.insert("tokenizer.ggml.model".to_string(), V::String("gpt2".into()));
    md.insert("tokenizer.ggml.pre".to_string(), V::String("qwen2".into()));
    md.insert(
        "tokenizer.ggml.tokens".to_string(),
        V::Array(tokens.iter().map(|t| V::String(t.clone())).collect()),
    );
    md.insert(
        "tokenizer.ggml.merges".to_string(),
        V::Array(merges.iter().map(|t| V::String(t.clone())).collect()),
    );
    md.insert(
        "tokenizer.ggml.token_type".to_string(),
        V::Array(types.iter().map(|&t| V::I32(t)).collect()),
    );
    let tok = crate::tokenizer::Tokenizer::from_gguf(&md)?;
    tok.inner()
        .save(dir.join("tokenizer.json"), false)
        .map_err(|e| anyhow::anyhow!("saving tokenizer.json: {e}"))?;
    let tok_cfg = serde_json::json!({
        "eos_token": "<|im_end|>",
        "add_bos_token": false,
        "chat_template": TINY_TEMPLATE,
    });
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&tok_cfg)?,
    )?;
    Ok(())
}

/// Uniform values in `[-scale, scale]` from a xorshift stream (reproducible test weights).
struct Uniform(u64);

impl Uniform {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn tensor(&mut self, shape: &[usize], scale: f32) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| {
                self.0 ^= self.0 << 13;
                self.0 ^= self.0 >> 7;
                self.0 ^= self.0 << 17;
                ((self.0 >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32 * scale
            })
            .collect();
        Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
    }

    /// `1 + U(-scale, scale)` (a norm weight).
    fn norm(&mut self, n: usize, scale: f32) -> Result<Tensor> {
        Ok((self.tensor(&[n], scale)? + 1.0)?)
    }
}

/// Random weights of a head block of the target's shape under `prefix` (HF names of the dense
/// block).
fn random_block(u: &mut Uniform, target: &crate::model::Model, prefix: &str) -> Result<Vec<(String, Tensor)>> {
    let c = target.config();
    // The order the random stream is drawn in (saved heads depend on it).
    let roles = [
        Role::AttnNorm,
        Role::FfnNorm,
        Role::AttnQ,
        Role::AttnK,
        Role::AttnV,
        Role::AttnOutput,
        Role::FfnGate,
        Role::FfnUp,
        Role::FfnDown,
        Role::AttnQBias,
        Role::AttnKBias,
        Role::AttnVBias,
        Role::AttnQNorm,
        Role::AttnKNorm,
    ];
    let mut w = Vec::new();
    for role in roles.into_iter().filter(|&r| tiny_has(c.family, r)) {
        let s = crate::arch::spec(llama::TENSORS, role);
        let name = format!("{prefix}{}", s.base(BundleFormat::Hf));
        w.push((name, random_for(u, role, &(s.shape)(c))?));
    }
    Ok(w)
}

/// Write a random-weight MTP head for `target` into the directory `dir` (config.json +
/// model.safetensors) in `layout`'s tensor names, optionally with a reduced draft vocabulary.
pub fn write_random_mtp_head(
    dir: &Path,
    target: &crate::model::Model,
    layout: crate::speculative::mtp::MtpLayout,
    draft_vocab: Option<&[u32]>,
    seed: u64,
) -> Result<()> {
    write_random_fused_mtp_head(dir, target, layout, draft_vocab, None, seed)
}

/// [`write_random_mtp_head`], reading fused features (EAGLE-3) of the target layers `fused`
/// when given: a random `hidden_fc.weight` `[h, len × h]` and `target_layer_ids` in the config.
pub fn write_random_fused_mtp_head(
    dir: &Path,
    target: &crate::model::Model,
    layout: crate::speculative::mtp::MtpLayout,
    draft_vocab: Option<&[u32]>,
    fused: Option<&[usize]>,
    seed: u64,
) -> Result<()> {
    use crate::speculative::mtp::MtpLayout;
    std::fs::create_dir_all(dir)?;
    let mut u = Uniform::new(seed);
    let c = target.config();
    let h = c.hidden_size;
    let (p, names) = match layout {
        MtpLayout::DeepseekV3 => (
            BundleFormat::Hf.layer_prefix(c.num_layers),
            [
                "enorm.weight",
                "hnorm.weight",
                "eh_proj.weight",
                "shared_head.norm.weight",
            ],
        ),
        MtpLayout::Qwen3Next => (
            "mtp.".to_string(),
            [
                "pre_fc_norm_embedding.weight",
                "pre_fc_norm_hidden.weight",
                "fc.weight",
                "norm.weight",
            ],
        ),
    };
    let block_prefix = match layout {
        MtpLayout::DeepseekV3 => p.clone(),
        MtpLayout::Qwen3Next => "mtp.layers.0.".to_string(),
    };
    let mut map: HashMap<String, Tensor> = random_block(&mut u, target, &block_prefix)?.into_iter().collect();
    map.insert(format!("{p}{}", names[0]), u.norm(h, 0.1)?);
    map.insert(format!("{p}{}", names[1]), u.norm(h, 0.1)?);
    map.insert(format!("{p}{}", names[2]), u.tensor(&[h, 2 * h], 0.3)?);
    map.insert(format!("{p}{}", names[3]), u.norm(h, 0.1)?);
    if let Some(layers) = fused {
        map.insert(format!("{p}hidden_fc.weight"), u.tensor(&[h, layers.len() * h], 0.3)?);
    }
    if let Some(ids) = draft_vocab {
        let ids: Vec<i64> = ids.iter().map(|&t| t as i64).collect();
        let n = ids.len();
        map.insert("draft_vocab".into(), Tensor::from_vec(ids, n, &Device::Cpu)?);
    }
    candle_core::safetensors::save(&map, dir.join("model.safetensors"))?;
    let mut config = serde_json::json!({
        "model_type": "specula_mtp",
        "num_nextn_predict_layers": 1,
        "num_hidden_layers": c.num_layers,
        "vocab_size": c.vocab_size,
        "hidden_source": "pre_norm",
    });
    if let Some(layers) = fused {
        config["target_layer_ids"] = serde_json::json!(layers);
    }
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config)?)?;
    Ok(())
}

/// Write a random-weight block drafter (DFlash layout) for `target` into `dir`: `layers`
/// drafter layers of the target's block shape, reading the target's `target_layer_ids`.
pub fn write_random_block_drafter(
    dir: &Path,
    target: &crate::model::Model,
    block_size: usize,
    target_layer_ids: &[usize],
    layers: usize,
    seed: u64,
) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut u = Uniform::new(seed);
    let c = target.config();
    let h = c.hidden_size;
    let mut map: HashMap<String, Tensor> = HashMap::new();
    for i in 0..layers {
        map.extend(random_block(&mut u, target, &format!("layers.{i}."))?);
    }
    map.insert("fc.weight".into(), u.tensor(&[h, target_layer_ids.len() * h], 0.3)?);
    map.insert("hidden_norm.weight".into(), u.norm(h, 0.1)?);
    map.insert("norm.weight".into(), u.norm(h, 0.1)?);
    candle_core::safetensors::save(&map, dir.join("model.safetensors"))?;
    let config = serde_json::json!({
        "model_type": "specula_block_drafter",
        "block_size": block_size,
        "target_layer_ids": target_layer_ids,
        "mask_token_id": 0,
        "num_hidden_layers": layers,
        "vocab_size": c.vocab_size,
    });
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&config)?)?;
    Ok(())
}
