//! The dense Llama block, with the flags of its descendants: Llama (and Mistral's same layout),
//! Qwen2 (biases on q/k/v) and Qwen3 (per-head RMSNorm on q and k before RoPE).
//!
//! Reference: Touvron et al. 2023 (Llama); llama.cpp `src/models/llama.cpp`, `qwen2.cpp`,
//! `qwen3.cpp`; transformers `modeling_llama.py`, `modeling_qwen2.py`, `modeling_qwen3.py`.
//! Pre-norm blocks: RMSNorm → grouped-query attention with RoPE → residual → RMSNorm → SwiGLU
//! MLP → residual; a final RMSNorm and the LM head (tied to the embedding when the bundle has no
//! separate one). The forward is [`crate::model::Model::forward`].

use std::collections::HashMap;

use anyhow::{anyhow, bail, Result};
use candle_core::quantized::gguf_file::Value;
use candle_core::Device;
use serde_json::Value as Json;

use super::shape::*;
use super::{
    spec, AttentionKind, BundleFormat, Kind, LayerPlan, MlpKind, ModelConfig, Role, RopeStyle, StateKind, TensorSpec,
    WeightSource,
};
use crate::inspect::gguf::{meta_f64, meta_usize};
use crate::model::{Block, Embedding, Linear, Mlp, Model};

/// Which model a config describes: a member of the dense Llama family (each sets flags of the
/// one block), or a model of another architecture file, by its registered name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Llama,
    Qwen2,
    Qwen3,
    /// A family read by another [`super::Architecture`]: its [`super::Architecture::name`].
    Other(&'static str),
}

impl Family {
    /// Parse a GGUF `general.architecture` or HF `model_type` value naming a member of the
    /// dense Llama family.
    pub fn parse(s: &str) -> Option<Family> {
        match s {
            "llama" | "mistral" => Some(Family::Llama),
            "qwen2" => Some(Family::Qwen2),
            "qwen3" => Some(Family::Qwen3),
            _ => None,
        }
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Other(name) => name,
        }
    }
}

impl serde::Serialize for Family {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// The dense Llama / Qwen2 / Qwen3 block.
#[derive(Debug)]
pub struct Llama;

/// Rows of the dense block's schema that other families' schemas share (the same names in both
/// formats, the same shapes).
pub const TOKEN_EMBD: TensorSpec = TensorSpec::new(
    Role::TokenEmbedding,
    "token_embd.weight",
    "model.embed_tokens.weight",
    false,
    true,
    Kind::Table,
    vocab_by_hidden,
);

pub const ATTN_NORM: TensorSpec = TensorSpec::new(
    Role::AttnNorm,
    "attn_norm.weight",
    "input_layernorm.weight",
    true,
    true,
    Kind::Vector,
    hidden,
);

pub const ATTN_Q: TensorSpec = TensorSpec::new(
    Role::AttnQ,
    "attn_q.weight",
    "self_attn.q_proj.weight",
    true,
    true,
    Kind::Matrix,
    q_proj,
);

pub const ATTN_K: TensorSpec = TensorSpec::new(
    Role::AttnK,
    "attn_k.weight",
    "self_attn.k_proj.weight",
    true,
    true,
    Kind::Matrix,
    kv_proj,
);

pub const ATTN_V: TensorSpec = TensorSpec::new(
    Role::AttnV,
    "attn_v.weight",
    "self_attn.v_proj.weight",
    true,
    true,
    Kind::Matrix,
    kv_proj,
);

pub const ATTN_OUTPUT: TensorSpec = TensorSpec::new(
    Role::AttnOutput,
    "attn_output.weight",
    "self_attn.o_proj.weight",
    true,
    true,
    Kind::Matrix,
    o_proj,
);

pub const ATTN_Q_BIAS: TensorSpec = TensorSpec::new(
    Role::AttnQBias,
    "attn_q.bias",
    "self_attn.q_proj.bias",
    true,
    false,
    Kind::Vector,
    q_out,
);

pub const ATTN_K_BIAS: TensorSpec = TensorSpec::new(
    Role::AttnKBias,
    "attn_k.bias",
    "self_attn.k_proj.bias",
    true,
    false,
    Kind::Vector,
    kv_out,
);

pub const ATTN_V_BIAS: TensorSpec = TensorSpec::new(
    Role::AttnVBias,
    "attn_v.bias",
    "self_attn.v_proj.bias",
    true,
    false,
    Kind::Vector,
    kv_out,
);

pub const ATTN_Q_NORM: TensorSpec = TensorSpec::new(
    Role::AttnQNorm,
    "attn_q_norm.weight",
    "self_attn.q_norm.weight",
    true,
    false,
    Kind::Vector,
    head_dim,
);

pub const ATTN_K_NORM: TensorSpec = TensorSpec::new(
    Role::AttnKNorm,
    "attn_k_norm.weight",
    "self_attn.k_norm.weight",
    true,
    false,
    Kind::Vector,
    head_dim,
);

pub const FFN_NORM: TensorSpec = TensorSpec::new(
    Role::FfnNorm,
    "ffn_norm.weight",
    "post_attention_layernorm.weight",
    true,
    true,
    Kind::Vector,
    hidden,
);

pub const FFN_GATE: TensorSpec = TensorSpec::new(
    Role::FfnGate,
    "ffn_gate.weight",
    "mlp.gate_proj.weight",
    true,
    true,
    Kind::Matrix,
    up_proj,
);

pub const FFN_UP: TensorSpec = TensorSpec::new(
    Role::FfnUp,
    "ffn_up.weight",
    "mlp.up_proj.weight",
    true,
    true,
    Kind::Matrix,
    up_proj,
);

pub const FFN_DOWN: TensorSpec = TensorSpec::new(
    Role::FfnDown,
    "ffn_down.weight",
    "mlp.down_proj.weight",
    true,
    true,
    Kind::Matrix,
    down_proj,
);

pub const OUTPUT_NORM: TensorSpec = TensorSpec::new(
    Role::OutputNorm,
    "output_norm.weight",
    "model.norm.weight",
    false,
    true,
    Kind::Vector,
    hidden,
);

pub const OUTPUT: TensorSpec = TensorSpec::new(
    Role::Output,
    "output.weight",
    "lm_head.weight",
    false,
    false,
    Kind::Matrix,
    vocab_by_hidden,
);

/// The tensor schema of the dense block, in the order a layer's tensors are listed.
pub static TENSORS: &[TensorSpec] = &[
    TOKEN_EMBD,
    ATTN_NORM,
    ATTN_Q,
    ATTN_K,
    ATTN_V,
    ATTN_OUTPUT,
    ATTN_Q_BIAS,
    ATTN_K_BIAS,
    ATTN_V_BIAS,
    ATTN_Q_NORM,
    ATTN_K_NORM,
    FFN_NORM,
    FFN_GATE,
    FFN_UP,
    FFN_DOWN,
    OUTPUT_NORM,
    OUTPUT,
    // llama.cpp's converter writes Llama 3.1's RoPE scaling as a tensor; HF keeps it in the
    // config (not read: the catalog's HF bundles do not use it).
    TensorSpec::new(
        Role::RopeFreqs,
        "rope_freqs.weight",
        "",
        false,
        false,
        Kind::Vector,
        half_head_dim,
    ),
];

/// The name of `role` in `format` (`layer` for a per-layer tensor): how code outside this
/// module names a tensor of the dense block (draft heads, which reuse the block, among them).
pub fn name(role: Role, format: BundleFormat, layer: usize) -> String {
    spec(TENSORS, role).name(format, layer)
}

/// The name of a per-layer `role` without the layer prefix (`self_attn.q_proj.weight`).
pub fn base(role: Role, format: BundleFormat) -> &'static str {
    spec(TENSORS, role).base(format)
}

/// A projection's name stem (its weight's name less `.weight`): `self_attn.q_proj`, `attn_q`.
pub fn stem(role: Role, format: BundleFormat) -> &'static str {
    let b = base(role, format);
    b.strip_suffix(".weight").unwrap_or(b)
}

/// Whether `hf_base` (a per-layer HF name without the layer prefix) is a tensor of the dense
/// block ([`TENSORS`]): what a draft head copies from a target's layer.
pub fn is_dense_block_tensor(hf_base: &str) -> bool {
    !hf_base.is_empty() && TENSORS.iter().any(|s| s.per_layer && s.hf == hf_base)
}

/// The GGUF metadata keys a config needs (after `{arch}.`).
const GGUF_REQUIRED: &[&str] = &[
    "embedding_length",
    "attention.head_count",
    "feed_forward_length",
    "block_count",
    "context_length",
];

/// The `config.json` fields a config needs.
const HF_REQUIRED: &[&str] = &[
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
];

/// An unsigned integer field of `config.json`; None when absent or of another type.
pub fn json_usize(c: &Json, k: &str) -> Option<usize> {
    c.get(k).and_then(Json::as_u64).map(|x| x as usize)
}

/// The GGUF metadata of a dense config under `arch.` keys (llama.cpp's names), as
/// [`dense_config_from_gguf`] reads them.
pub fn dense_gguf_metadata(arch: &str, c: &ModelConfig) -> Vec<(String, Value)> {
    let u = |x: usize| Value::U32(x as u32);
    vec![
        (format!("{arch}.block_count"), u(c.num_layers)),
        (format!("{arch}.context_length"), u(c.context_length)),
        (format!("{arch}.embedding_length"), u(c.hidden_size)),
        (format!("{arch}.feed_forward_length"), u(c.intermediate_size)),
        (format!("{arch}.attention.head_count"), u(c.num_heads)),
        (format!("{arch}.attention.head_count_kv"), u(c.num_kv_heads)),
        (format!("{arch}.attention.key_length"), u(c.head_dim)),
        (
            format!("{arch}.attention.layer_norm_rms_epsilon"),
            Value::F32(c.rms_norm_eps as f32),
        ),
        (format!("{arch}.rope.freq_base"), Value::F32(c.rope_theta as f32)),
    ]
}

/// The `config.json` of a dense config (transformers' field names) with `model_type`.
pub fn dense_hf_config(model_type: &str, c: &ModelConfig) -> Json {
    serde_json::json!({
        "model_type": model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.context_length,
    })
}

/// A dense config from GGUF metadata under `arch.` keys (llama.cpp's names), the vocabulary
/// from the embedding's rows (`embd`, read through `dims`). Errors name the missing key.
pub fn dense_config_from_gguf(
    arch: &str,
    family: Family,
    rope_style: RopeStyle,
    md: &HashMap<String, Value>,
    embd: &str,
    dims: &dyn Fn(&str) -> Option<Vec<usize>>,
) -> Result<ModelConfig> {
    let req = |k: &str| -> Result<usize> {
        let key = format!("{arch}.{k}");
        meta_usize(md, &key).ok_or_else(|| anyhow!("missing metadata key '{key}'"))
    };
    let hidden = req("embedding_length")?;
    let heads = req("attention.head_count")?;
    let kv_heads = meta_usize(md, &format!("{arch}.attention.head_count_kv")).unwrap_or(heads);
    let head_dim = meta_usize(md, &format!("{arch}.attention.key_length")).unwrap_or(hidden / heads.max(1));
    let vocab = match dims(embd).and_then(|d| d.first().copied()) {
        Some(v) => v,
        None => bail!("missing tensor '{embd}'"),
    };
    Ok(ModelConfig {
        family,
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: req("feed_forward_length")?,
        num_layers: req("block_count")?,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        rms_norm_eps: meta_f64(md, &format!("{arch}.attention.layer_norm_rms_epsilon")).unwrap_or(1e-6),
        rope_theta: meta_f64(md, &format!("{arch}.rope.freq_base")).unwrap_or(10_000.0),
        context_length: req("context_length")?,
        rope_style,
        sliding_window: None,
        query_scale: None,
        rope_freq_scale: None,
        moe: None,
    })
}

/// The RoPE base in `config.json`'s text part `c`: transformers 4's top-level `rope_theta`, or
/// transformers 5's `rope_parameters.rope_theta` (per layer type `kind`, e.g.
/// `"sliding_attention"`, when the parameters are given per layer type).
pub fn hf_rope_theta(c: &Json, kind: Option<&str>) -> Option<f64> {
    let params = c.get("rope_parameters");
    let typed = kind.and_then(|k| params?.get(k)?.get("rope_theta")?.as_f64());
    typed
        .or_else(|| params?.get("rope_theta")?.as_f64())
        .or_else(|| c.get("rope_theta")?.as_f64())
}

/// A dense config from `config.json`'s text part `c` (transformers' field names). Errors name
/// the missing field.
pub fn dense_config_from_hf(family: Family, c: &Json) -> Result<ModelConfig> {
    let field =
        |k: &str| -> Result<usize> { json_usize(c, k).ok_or_else(|| anyhow!("missing or non-integer field '{k}'")) };
    let hidden = field("hidden_size")?;
    let heads = field("num_attention_heads")?;
    Ok(ModelConfig {
        family,
        vocab_size: field("vocab_size")?,
        hidden_size: hidden,
        intermediate_size: field("intermediate_size")?,
        num_layers: field("num_hidden_layers")?,
        num_heads: heads,
        num_kv_heads: json_usize(c, "num_key_value_heads").unwrap_or(heads),
        head_dim: json_usize(c, "head_dim").unwrap_or(hidden / heads.max(1)),
        rms_norm_eps: c.get("rms_norm_eps").and_then(Json::as_f64).unwrap_or(1e-6),
        rope_theta: hf_rope_theta(c, None).unwrap_or(10_000.0),
        context_length: field("max_position_embeddings")?,
        rope_style: RopeStyle::Neox,
        sliding_window: None,
        query_scale: None,
        rope_freq_scale: None,
        moe: None,
    })
}

impl super::Architecture for Llama {
    fn name(&self) -> &'static str {
        "llama"
    }

    fn gguf_names(&self) -> &'static [&'static str] {
        &["llama", "mistral", "qwen2", "qwen3"]
    }

    fn hf_model_types(&self) -> &'static [&'static str] {
        &["llama", "mistral", "qwen2", "qwen3"]
    }

    fn aliases(&self) -> &'static [&'static str] {
        &["mistral"]
    }

    fn gguf_required_keys(&self) -> &'static [&'static str] {
        GGUF_REQUIRED
    }

    fn hf_required_fields(&self) -> &'static [&'static str] {
        HF_REQUIRED
    }

    fn config_from_gguf(
        &self,
        arch: &str,
        md: &HashMap<String, Value>,
        dims: &dyn Fn(&str) -> Option<Vec<usize>>,
    ) -> Result<ModelConfig> {
        let family = Family::parse(arch).ok_or_else(|| anyhow!("'{arch}' is not a member of the llama family"))?;
        // llama.cpp's converter permutes Llama's q/k rows for adjacent-pair RoPE; Qwen files
        // keep the halves.
        let rope = match family {
            Family::Llama => RopeStyle::Interleaved,
            _ => RopeStyle::Neox,
        };
        let embd = name(Role::TokenEmbedding, BundleFormat::Gguf, 0);
        dense_config_from_gguf(arch, family, rope, md, &embd, dims)
    }

    fn config_from_hf(&self, model_type: &str, c: &Json) -> Result<ModelConfig> {
        let family =
            Family::parse(model_type).ok_or_else(|| anyhow!("'{model_type}' is not a member of the llama family"))?;
        dense_config_from_hf(family, c)
    }

    fn tensors(&self) -> &'static [TensorSpec] {
        TENSORS
    }

    fn layer_plan(&self, config: &ModelConfig) -> Vec<LayerPlan> {
        let plan = LayerPlan {
            attention: AttentionKind::Full,
            mlp: MlpKind::DenseSwiGlu,
            qkv_bias: config.family == Family::Qwen2,
            qk_norm: config.family == Family::Qwen3,
            parallel: false,
            post_norms: false,
        };
        vec![plan; config.num_layers]
    }

    fn state_kind(&self) -> StateKind {
        StateKind::KvRows
    }

    fn runs_on_cuda(&self) -> bool {
        true
    }

    fn gguf_metadata(&self, c: &ModelConfig) -> Vec<(String, Value)> {
        dense_gguf_metadata(c.family.as_str(), c)
    }

    fn hf_config(&self, c: &ModelConfig) -> Json {
        dense_hf_config(c.family.as_str(), c)
    }

    fn build(&self, config: ModelConfig, w: &mut dyn WeightSource, device: &Device) -> Result<Model> {
        build_dense(TENSORS, config, w, device, 0.0)
    }
}

/// Read a model of the dense block's roles from `w` by `schema` (the dense block's
/// [`TENSORS`], or a family's own table with the same roles and more: the post-norms, when
/// the schema has them and the bundle holds them). `norm_shift` is added to every norm
/// weight as read (Gemma's HF checkpoints store `w` of a `(1 + w)` norm; 0 elsewhere).
/// Errors name the file and tensor (from `w`).
pub fn build_dense(
    schema: &'static [TensorSpec],
    config: ModelConfig,
    w: &mut dyn WeightSource,
    device: &Device,
    norm_shift: f32,
) -> Result<Model> {
    build_blocks(schema, config, w, device, norm_shift, &mut |w, l| {
        dense_mlp(schema, w, l)
    })
}

/// The name of `role`'s row in `schema` for `format` at `layer`: the first row of that role
/// with a name in that format; None when there is none.
pub fn schema_name(schema: &[TensorSpec], role: Role, format: BundleFormat, layer: usize) -> Option<String> {
    let s = schema.iter().find(|s| s.role == role && !s.base(format).is_empty())?;
    Some(s.name(format, layer))
}

/// The dense gated MLP of layer `l` (the schema's `FfnGate`, `FfnUp`, `FfnDown`).
pub fn dense_mlp(schema: &[TensorSpec], w: &mut dyn WeightSource, l: usize) -> Result<Mlp> {
    let f = w.format();
    let mut lin = |r: Role| -> Result<Linear> {
        let n = schema_name(schema, r, f, l).ok_or_else(|| anyhow!("the tensor schema has no {r:?}"))?;
        w.linear(&n, None)
    };
    Ok(Mlp::dense(lin(Role::FfnGate)?, lin(Role::FfnUp)?, lin(Role::FfnDown)?))
}

/// [`build_dense`] with each layer's MLP read by `mlp` (a family whose MLPs differ by layer,
/// such as MoE): the attention, the norms, the embedding and the LM head by `schema`.
pub fn build_blocks(
    schema: &'static [TensorSpec],
    config: ModelConfig,
    w: &mut dyn WeightSource,
    device: &Device,
    norm_shift: f32,
    mlp: &mut dyn FnMut(&mut dyn WeightSource, usize) -> Result<Mlp>,
) -> Result<Model> {
    let f = w.format();
    let name = |r: Role, l: usize| schema_name(schema, r, f, l);
    let need = |r: Role, l: usize| name(r, l).ok_or_else(|| anyhow!("the tensor schema has no {r:?}"));
    let norm = |w: &mut dyn WeightSource, n: &str| -> Result<candle_core::Tensor> {
        let t = w.dense(n)?;
        Ok(if norm_shift != 0.0 {
            (t + f64::from(norm_shift))?
        } else {
            t
        })
    };
    let embd = w.table(&need(Role::TokenEmbedding, 0)?)?;
    let mut blocks = Vec::with_capacity(config.num_layers);
    for l in 0..config.num_layers {
        let present = |w: &dyn WeightSource, r: Role| name(r, l).filter(|n| w.has(n));
        let lin = |w: &mut dyn WeightSource, weight: Role, bias: Option<Role>| -> Result<Linear> {
            let b = bias.and_then(|b| present(w, b));
            w.linear(&need(weight, l)?, b.as_deref())
        };
        let q = lin(w, Role::AttnQ, Some(Role::AttnQBias))?;
        let k = lin(w, Role::AttnK, Some(Role::AttnKBias))?;
        let v = lin(w, Role::AttnV, Some(Role::AttnVBias))?;
        let o = lin(w, Role::AttnOutput, None)?;
        let layer_mlp = mlp(w, l)?;
        let opt_norm = |w: &mut dyn WeightSource, r: Role| -> Result<Option<candle_core::Tensor>> {
            present(w, r).map(|n| norm(w, &n)).transpose()
        };
        let q_norm = opt_norm(w, Role::AttnQNorm)?;
        let k_norm = opt_norm(w, Role::AttnKNorm)?;
        let post_attn_norm = opt_norm(w, Role::AttnPostNorm)?;
        let post_ffn_norm = opt_norm(w, Role::FfnPostNorm)?;
        let attn_norm = norm(w, &need(Role::AttnNorm, l)?)?;
        let ffn_norm = norm(w, &need(Role::FfnNorm, l)?)?;
        blocks.push(Block {
            attn_norm,
            q,
            k,
            v,
            o,
            q_norm,
            k_norm,
            ffn_norm: Some(ffn_norm),
            mlp: layer_mlp,
            post_attn_norm,
            post_ffn_norm,
        });
    }
    let output_norm = norm(w, &need(Role::OutputNorm, 0)?)?;
    let out = name(Role::Output, 0).filter(|n| w.has(n));
    let lm_table = match out {
        Some(n) => w.table(&n)?,
        None => embd.clone(),
    };
    let lm_head = lm_table.to_linear()?;
    let rope = name(Role::RopeFreqs, 0).filter(|n| w.has(n));
    let rope_factors = match rope {
        Some(n) => Some(w.dense(&n)?.flatten_all()?.to_vec1::<f32>()?),
        None => None,
    };
    let quantized_table = matches!(lm_table, Embedding::Quantized(_));
    let mut model = Model::new(config, embd, blocks, output_norm, lm_head, rope_factors, device.clone())?;
    // Draft heads borrow rows of a quantized LM head ([`Model::lm_head_rows`]).
    if quantized_table {
        model.set_lm_head_table(lm_table);
    }
    Ok(model)
}
