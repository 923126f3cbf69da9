//! Gemma 3 (text): the dense block with sandwich norms, GeGLU, QK-norm and sliding-window
//! attention on most layers.
//!
//! Reference: Gemma Team 2025, "Gemma 3 Technical Report"; llama.cpp `src/models/gemma3.cpp`;
//! transformers `modeling_gemma3.py` (`Gemma3ForCausalLM`, `model_type` `gemma3_text`).
//!
//! Per block: RMSNorm → attention (q/k per-head RMSNorm before RoPE, queries scaled by
//! `query_pre_attn_scalar^-1/2` after it) → RMSNorm → residual add → RMSNorm → GeGLU MLP
//! (GELU with the tanh approximation) → RMSNorm → residual add. The embeddings are multiplied by
//! `sqrt(hidden)`; the LM head is tied to the embedding. Five of every six layers (the config's
//! pattern) attend over a sliding window (512 positions for the small models) with their own
//! RoPE base (10,000; the global layers use 1,000,000, with linear scaling on the larger models).
//!
//! Gemma's RMSNorm multiplies by `1 + w`. HF checkpoints store `w`; llama.cpp's converter adds
//! the one when it writes a GGUF file, so GGUF norms are read as stored and HF norms plus one.

use std::collections::HashMap;

use anyhow::{anyhow, bail, Result};
use candle_core::quantized::gguf_file::Value;
use candle_core::Device;
use serde_json::Value as Json;

use super::llama::{
    self, build_dense, dense_config_from_gguf, dense_config_from_hf, dense_gguf_metadata, dense_hf_config,
    hf_rope_theta,
};
use super::shape::*;
use super::{
    AttentionKind, BundleFormat, Kind, LayerPlan, MlpKind, ModelConfig, Role, RopeStyle, SlidingWindow, StateKind,
    TensorSpec, WeightSource,
};
use crate::inspect::gguf::{meta_f64, meta_usize};
use crate::model::{Family, LayerPass, Model};

/// The Gemma 3 text model.
#[derive(Debug)]
pub struct Gemma3;

const NAME: &str = "gemma3";

/// llama.cpp's default layer pattern: every sixth layer global (`set_swa_pattern(6)`).
const DEFAULT_PATTERN: usize = 6;
/// llama.cpp's default RoPE base of the windowed layers (`rope_freq_base_train_swa`).
const DEFAULT_LOCAL_THETA: f64 = 10_000.0;

/// The tensor schema, in the order a layer's tensors are listed.
pub static TENSORS: &[TensorSpec] = &[
    llama::TOKEN_EMBD,
    llama::ATTN_NORM,
    llama::ATTN_Q,
    llama::ATTN_K,
    llama::ATTN_V,
    TensorSpec::new(
        Role::AttnQNorm,
        "attn_q_norm.weight",
        "self_attn.q_norm.weight",
        true,
        true,
        Kind::Vector,
        head_dim,
    ),
    TensorSpec::new(
        Role::AttnKNorm,
        "attn_k_norm.weight",
        "self_attn.k_norm.weight",
        true,
        true,
        Kind::Vector,
        head_dim,
    ),
    llama::ATTN_OUTPUT,
    // transformers' `post_attention_layernorm` is Gemma's post-attention norm (in Llama the
    // same name is the norm before the MLP).
    TensorSpec::new(
        Role::AttnPostNorm,
        "post_attention_norm.weight",
        "post_attention_layernorm.weight",
        true,
        true,
        Kind::Vector,
        hidden,
    ),
    TensorSpec::new(
        Role::FfnNorm,
        "ffn_norm.weight",
        "pre_feedforward_layernorm.weight",
        true,
        true,
        Kind::Vector,
        hidden,
    ),
    llama::FFN_GATE,
    llama::FFN_UP,
    llama::FFN_DOWN,
    TensorSpec::new(
        Role::FfnPostNorm,
        "post_ffw_norm.weight",
        "post_feedforward_layernorm.weight",
        true,
        true,
        Kind::Vector,
        hidden,
    ),
    llama::OUTPUT_NORM,
    llama::OUTPUT,
];

/// Per layer, whether it is windowed under llama.cpp's pattern rule: layer `l` is global when
/// `l % pattern == pattern - 1` (pattern 0: every layer windowed).
fn pattern_layers(layers: usize, pattern: usize) -> Vec<bool> {
    (0..layers).map(|l| pattern == 0 || l % pattern < pattern - 1).collect()
}

/// The query scale of a config: `query_pre_attn_scalar^-1/2`, rounded to f32 as llama.cpp's
/// `f_attention_scale` is.
fn query_scale(scalar: f64) -> f64 {
    f64::from(1.0f32 / (scalar as f32).sqrt())
}

impl super::Architecture for Gemma3 {
    fn name(&self) -> &'static str {
        NAME
    }

    fn gguf_names(&self) -> &'static [&'static str] {
        &["gemma3"]
    }

    fn hf_model_types(&self) -> &'static [&'static str] {
        &["gemma3_text"]
    }

    fn gguf_required_keys(&self) -> &'static [&'static str] {
        // The dense block's config keys: Gemma's extras all have defaults.
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
        let embd = TENSORS[0].name(BundleFormat::Gguf, 0);
        let mut c = dense_config_from_gguf(arch, Family::Other(NAME), RopeStyle::Neox, md, &embd, dims)?;
        if let Some(cap) = meta_f64(md, &format!("{arch}.final_logit_softcapping")).filter(|&x| x != 0.0) {
            bail!("metadata '{arch}.final_logit_softcapping' = {cap}: logit soft-capping is not supported");
        }
        if let Some(w) = meta_usize(md, &format!("{arch}.attention.sliding_window")).filter(|&w| w > 0) {
            let key = format!("{arch}.attention.sliding_window_pattern");
            let layers = match md.get(&key) {
                None => pattern_layers(c.num_layers, DEFAULT_PATTERN),
                Some(Value::Array(a)) => {
                    let v: Vec<bool> = a.iter().filter_map(|x| x.to_bool().ok()).collect();
                    if v.len() != c.num_layers {
                        bail!("metadata '{key}' has {} booleans for {} layers", a.len(), c.num_layers);
                    }
                    v
                }
                Some(_) => {
                    let p = meta_usize(md, &key).ok_or_else(|| anyhow!("metadata '{key}' is not a count"))?;
                    pattern_layers(c.num_layers, p)
                }
            };
            c.sliding_window = Some(SlidingWindow {
                size: w,
                layers,
                rope_theta: meta_f64(md, &format!("{arch}.rope.freq_base_swa")).unwrap_or(DEFAULT_LOCAL_THETA),
            });
        }
        // llama.cpp: 1/sqrt(head_dim), except the 27B model (62 layers), whose
        // query_pre_attn_scalar is hidden / heads.
        let scalar = if c.num_layers == 62 {
            (c.hidden_size / c.num_heads) as f64
        } else {
            c.head_dim as f64
        };
        c.query_scale = Some(query_scale(scalar));
        if let Some(f) = meta_f64(md, &format!("{arch}.rope.scaling.factor")).filter(|&f| f != 0.0 && f != 1.0) {
            let kind = md
                .get(&format!("{arch}.rope.scaling.type"))
                .and_then(|v| v.to_string().ok())
                .map(String::as_str)
                .unwrap_or("linear");
            if kind != "linear" {
                bail!("metadata '{arch}.rope.scaling.type' = '{kind}': only linear RoPE scaling is supported");
            }
            c.rope_freq_scale = Some(f64::from(1.0f32 / f as f32));
        }
        Ok(c)
    }

    fn config_from_hf(&self, _model_type: &str, j: &Json) -> Result<ModelConfig> {
        let mut c = dense_config_from_hf(Family::Other(NAME), j)?;
        // transformers 5 writes the bases per layer type (`rope_parameters`), 4 at the top level.
        if let Some(theta) = hf_rope_theta(j, Some("full_attention")) {
            c.rope_theta = theta;
        }
        for cap in ["final_logit_softcapping", "attn_logit_softcapping"] {
            if let Some(v) = j.get(cap).and_then(Json::as_f64) {
                bail!("field '{cap}' = {v}: logit soft-capping is not supported");
            }
        }
        if let Some(act) = j.get("hidden_activation").and_then(Json::as_str) {
            if act != "gelu_pytorch_tanh" {
                bail!("field 'hidden_activation' = '{act}': only 'gelu_pytorch_tanh' is supported");
            }
        }
        if let Some(w) = j.get("sliding_window").and_then(Json::as_u64).filter(|&w| w > 0) {
            let layers = match j.get("layer_types").and_then(Json::as_array) {
                Some(t) => {
                    let v: Vec<bool> = t.iter().map(|x| x.as_str() == Some("sliding_attention")).collect();
                    if v.len() != c.num_layers {
                        bail!(
                            "field 'layer_types' has {} entries for {} layers",
                            v.len(),
                            c.num_layers
                        );
                    }
                    v
                }
                None => {
                    let p = j
                        .get("sliding_window_pattern")
                        .and_then(Json::as_u64)
                        .map_or(DEFAULT_PATTERN, |p| p as usize);
                    pattern_layers(c.num_layers, p)
                }
            };
            c.sliding_window = Some(SlidingWindow {
                size: w as usize,
                layers,
                rope_theta: j
                    .get("rope_local_base_freq")
                    .and_then(Json::as_f64)
                    .or_else(|| hf_rope_theta(j, Some("sliding_attention")))
                    .unwrap_or(DEFAULT_LOCAL_THETA),
            });
        }
        let scalar = j
            .get("query_pre_attn_scalar")
            .and_then(Json::as_f64)
            .unwrap_or(c.head_dim as f64);
        c.query_scale = Some(query_scale(scalar));
        let scaling = j.get("rope_scaling").filter(|v| !v.is_null()).or_else(|| {
            // transformers 5: the full-attention layers' `rope_parameters` with a non-default type.
            let p = j.get("rope_parameters")?;
            let full = p.get("full_attention").unwrap_or(p);
            (full.get("rope_type").and_then(Json::as_str).unwrap_or("default") != "default").then_some(full)
        });
        if let Some(rs) = scaling {
            let kind = rs
                .get("rope_type")
                .or_else(|| rs.get("type"))
                .and_then(Json::as_str)
                .unwrap_or("");
            let factor = rs.get("factor").and_then(Json::as_f64).unwrap_or(1.0);
            if kind != "linear" {
                bail!("field 'rope_scaling.rope_type' = '{kind}': only linear RoPE scaling is supported");
            }
            if factor != 1.0 {
                c.rope_freq_scale = Some(f64::from(1.0f32 / factor as f32));
            }
        }
        Ok(c)
    }

    fn tensors(&self) -> &'static [TensorSpec] {
        TENSORS
    }

    fn layer_plan(&self, config: &ModelConfig) -> Vec<LayerPlan> {
        (0..config.num_layers)
            .map(|l| LayerPlan {
                attention: match &config.sliding_window {
                    Some(w) if w.layers.get(l).copied().unwrap_or(false) => AttentionKind::Sliding { window: w.size },
                    _ => AttentionKind::Full,
                },
                mlp: MlpKind::DenseGeGlu,
                qkv_bias: false,
                qk_norm: true,
                parallel: false,
                post_norms: true,
            })
            .collect()
    }

    fn state_kind(&self) -> StateKind {
        StateKind::KvRows
    }

    fn build(&self, config: ModelConfig, w: &mut dyn WeightSource, device: &Device) -> Result<Model> {
        let shift = match w.format() {
            BundleFormat::Gguf => 0.0,
            BundleFormat::Hf => 1.0,
        };
        build_dense(TENSORS, config, w, device, shift)
    }

    fn layer_forward(&self, layer: &mut LayerPass<'_, '_, '_>, x: &mut [f32]) -> Result<()> {
        layer.sandwich_norm_block(x)
    }

    fn embedding_scale(&self, config: &ModelConfig) -> Option<f32> {
        // llama.cpp: sqrtf(n_embd); transformers: the f32 rounding of hidden ** 0.5.
        Some((config.hidden_size as f32).sqrt())
    }

    fn gguf_metadata(&self, c: &ModelConfig) -> Vec<(String, Value)> {
        let mut md = dense_gguf_metadata(NAME, c);
        if let Some(w) = &c.sliding_window {
            md.push((format!("{NAME}.attention.sliding_window"), Value::U32(w.size as u32)));
            md.push((
                format!("{NAME}.attention.sliding_window_pattern"),
                Value::Array(w.layers.iter().map(|&b| Value::Bool(b)).collect()),
            ));
            md.push((format!("{NAME}.rope.freq_base_swa"), Value::F32(w.rope_theta as f32)));
        }
        md
    }

    fn hf_config(&self, c: &ModelConfig) -> Json {
        let mut j = dense_hf_config("gemma3_text", c);
        if let Some(w) = &c.sliding_window {
            j["sliding_window"] = w.size.into();
            j["layer_types"] = w
                .layers
                .iter()
                .map(|&b| if b { "sliding_attention" } else { "full_attention" })
                .collect::<Vec<_>>()
                .into();
            j["rope_local_base_freq"] = w.rope_theta.into();
        }
        if let Some(s) = c.query_scale {
            j["query_pre_attn_scalar"] = (1.0 / (s * s)).round().into();
        }
        j["hidden_activation"] = "gelu_pytorch_tanh".into();
        j
    }
}
