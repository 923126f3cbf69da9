//! Qwen2-MoE and Qwen3-MoE: the Qwen2 / Qwen3 attention block with Mixture-of-Experts MLPs.
//!
//! Reference: Qwen Team 2024, "Qwen2 Technical Report" (Qwen2-MoE: fine-grained experts plus a
//! shared expert); Qwen Team 2025, "Qwen3 Technical Report" (Qwen3-MoE: 128 experts, 8 active,
//! no shared expert); transformers `modeling_qwen2_moe.py`, `modeling_qwen3_moe.py`; llama.cpp
//! `src/models/qwen2moe.cpp`, `qwen3moe.cpp` and `build_moe_ffn` in `llama-graph.cpp`.
//!
//! Per block: RMSNorm → grouped-query attention (Qwen2-MoE: q/k/v biases; Qwen3-MoE: per-head
//! RMSNorm of q and k before RoPE) → residual → RMSNorm → MLP → residual. The MLP of an MoE
//! layer is [`crate::model::moe::MoeMlp`]: the router's softmax over the experts, the top-k
//! (`num_experts_per_tok`), renormalized when `norm_topk_prob`, the SwiGLU experts' outputs
//! summed by those weights; Qwen2-MoE adds a shared expert scaled by `sigmoid(gate · x)`.
//! Layers listed in `mlp_only_layers`, or off the `decoder_sparse_step` grid, have a dense
//! SwiGLU MLP of `intermediate_size` (transformers' rule; GGUF files mark an MoE layer by its
//! router tensor).
//!
//! Experts are stored stacked in GGUF (`ffn_{gate,up,down}_exps`, `[experts, out, in]`, each
//! expert kept in its quantized blocks) and one tensor per expert in HF checkpoints
//! (`mlp.experts.N.{gate,up,down}_proj.weight`; a bundle with transformers 5's fused
//! `mlp.experts.gate_up_proj` / `down_proj` is read as those by the HF loader).

use std::collections::HashMap;

use anyhow::{anyhow, bail, Result};
use candle_core::quantized::gguf_file::Value;
use candle_core::Device;
use serde_json::Value as Json;

use super::llama::{
    self, build_blocks, dense_config_from_gguf, dense_config_from_hf, dense_gguf_metadata, dense_hf_config, schema_name,
};
use super::shape::*;
use super::{
    AttentionKind, BundleFormat, Kind, LayerPlan, MlpKind, ModelConfig, MoeConfig, Role, RopeStyle, StateKind,
    TensorSpec, WeightSource,
};
use crate::inspect::gguf::meta_usize;
use crate::model::moe::{MoeMlp, SharedExpert};
use crate::model::{Family, GatedMlp, Linear, Mlp, Model};

/// Qwen2-MoE and Qwen3-MoE.
#[derive(Debug)]
pub struct QwenMoe;

/// The architecture's name (`inspect`), and the two families' GGUF names.
const NAME: &str = "qwen_moe";
const QWEN2MOE: &str = "qwen2moe";
const QWEN3MOE: &str = "qwen3moe";

const ROUTER: TensorSpec = TensorSpec::new(
    Role::FfnRouter,
    "ffn_gate_inp.weight",
    "mlp.gate.weight",
    true,
    true,
    Kind::Vector,
    router,
);

/// The routed experts: stacked in GGUF, one tensor each in HF (rows in the same order, so a
/// random bundle's values agree between the formats).
const GATE_EXPS: TensorSpec = TensorSpec::new(
    Role::FfnGateExps,
    "ffn_gate_exps.weight",
    "",
    true,
    true,
    Kind::Matrix,
    experts_up,
);
const GATE_EXP: TensorSpec = TensorSpec::new(
    Role::FfnGateExps,
    "",
    "mlp.experts.{e}.gate_proj.weight",
    true,
    true,
    Kind::Matrix,
    expert_up,
)
.experts();
const UP_EXPS: TensorSpec = TensorSpec::new(
    Role::FfnUpExps,
    "ffn_up_exps.weight",
    "",
    true,
    true,
    Kind::Matrix,
    experts_up,
);
const UP_EXP: TensorSpec = TensorSpec::new(
    Role::FfnUpExps,
    "",
    "mlp.experts.{e}.up_proj.weight",
    true,
    true,
    Kind::Matrix,
    expert_up,
)
.experts();
const DOWN_EXPS: TensorSpec = TensorSpec::new(
    Role::FfnDownExps,
    "ffn_down_exps.weight",
    "",
    true,
    true,
    Kind::Matrix,
    experts_down,
);
const DOWN_EXP: TensorSpec = TensorSpec::new(
    Role::FfnDownExps,
    "",
    "mlp.experts.{e}.down_proj.weight",
    true,
    true,
    Kind::Matrix,
    expert_down,
)
.experts();

const SHARED_GATE: TensorSpec = TensorSpec::new(
    Role::FfnGateShexp,
    "ffn_gate_shexp.weight",
    "mlp.shared_expert.gate_proj.weight",
    true,
    true,
    Kind::Matrix,
    shared_up,
);
const SHARED_UP: TensorSpec = TensorSpec::new(
    Role::FfnUpShexp,
    "ffn_up_shexp.weight",
    "mlp.shared_expert.up_proj.weight",
    true,
    true,
    Kind::Matrix,
    shared_up,
);
const SHARED_DOWN: TensorSpec = TensorSpec::new(
    Role::FfnDownShexp,
    "ffn_down_shexp.weight",
    "mlp.shared_expert.down_proj.weight",
    true,
    true,
    Kind::Matrix,
    shared_down,
);
/// The shared expert's gate, a one-output linear `[1, hidden]` (as llama.cpp's converter writes
/// it too).
const SHARED_ROUTER: TensorSpec = TensorSpec::new(
    Role::FfnRouterShexp,
    "ffn_gate_inp_shexp.weight",
    "mlp.shared_expert_gate.weight",
    true,
    true,
    Kind::Vector,
    shared_gate_row,
);

/// The tensor schema, in the order a layer's tensors are listed.
pub static TENSORS: &[TensorSpec] = &[
    llama::TOKEN_EMBD,
    llama::ATTN_NORM,
    llama::ATTN_Q,
    llama::ATTN_K,
    llama::ATTN_V,
    llama::ATTN_OUTPUT,
    llama::ATTN_Q_BIAS,
    llama::ATTN_K_BIAS,
    llama::ATTN_V_BIAS,
    llama::ATTN_Q_NORM,
    llama::ATTN_K_NORM,
    llama::FFN_NORM,
    llama::FFN_GATE,
    llama::FFN_UP,
    llama::FFN_DOWN,
    ROUTER,
    GATE_EXPS,
    GATE_EXP,
    UP_EXPS,
    UP_EXP,
    DOWN_EXPS,
    DOWN_EXP,
    SHARED_ROUTER,
    SHARED_GATE,
    SHARED_UP,
    SHARED_DOWN,
    llama::OUTPUT_NORM,
    llama::OUTPUT,
];

/// Whether a config is Qwen2-MoE's (q/k/v biases, a shared expert) rather than Qwen3-MoE's.
fn is_qwen2(c: &ModelConfig) -> bool {
    c.family == Family::Other(QWEN2MOE)
}

/// The GGUF family name of a GGUF `general.architecture` or HF `model_type`.
fn family_of(name: &str) -> Result<&'static str> {
    match name {
        QWEN2MOE | "qwen2_moe" => Ok(QWEN2MOE),
        QWEN3MOE | "qwen3_moe" => Ok(QWEN3MOE),
        _ => bail!("'{name}' is not a Qwen MoE model"),
    }
}

/// The most experts a layer may have: above every released MoE model (Qwen3: 128, DeepSeek-V3:
/// 256, Kimi K2: 384), and low enough that a config's count cannot make the loader or `inspect`
/// enumerate millions of tensor names.
pub const MAX_EXPERTS: usize = 4096;

/// Refuse an MoE config no bundle can hold: no experts or more than [`MAX_EXPERTS`], experts per
/// token outside `1..=experts`, experts of width 0. The errors name the key (`experts_key` ...).
fn check_moe(m: &MoeConfig, experts_key: &str, used_key: &str, width_key: &str) -> Result<()> {
    if m.experts == 0 || m.experts > MAX_EXPERTS {
        bail!("{experts_key} is {}: 1 to {MAX_EXPERTS} experts expected", m.experts);
    }
    if m.experts_per_token == 0 || m.experts_per_token > m.experts {
        bail!(
            "{used_key} is {}: 1 to {} (the experts) expected",
            m.experts_per_token,
            m.experts
        );
    }
    if m.expert_intermediate_size == 0 {
        bail!("{width_key} is 0");
    }
    Ok(())
}

/// transformers' rule for which layers are MoE: not in `mlp_only_layers`, and
/// `(layer + 1) % decoder_sparse_step == 0`.
fn hf_moe_layers(layers: usize, mlp_only: &[usize], step: usize) -> Vec<bool> {
    (0..layers)
        .map(|l| !mlp_only.contains(&l) && step > 0 && (l + 1) % step == 0)
        .collect()
}

impl super::Architecture for QwenMoe {
    fn name(&self) -> &'static str {
        NAME
    }

    fn gguf_names(&self) -> &'static [&'static str] {
        &[QWEN2MOE, QWEN3MOE]
    }

    fn hf_model_types(&self) -> &'static [&'static str] {
        &["qwen2_moe", "qwen3_moe"]
    }

    fn gguf_required_keys(&self) -> &'static [&'static str] {
        &[
            "embedding_length",
            "attention.head_count",
            "feed_forward_length",
            "block_count",
            "context_length",
            "expert_count",
            "expert_used_count",
        ]
    }

    fn hf_required_fields(&self) -> &'static [&'static str] {
        &[
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
            "num_experts_per_tok",
            "moe_intermediate_size",
        ]
    }

    fn config_from_gguf(
        &self,
        arch: &str,
        md: &HashMap<String, Value>,
        dims: &dyn Fn(&str) -> Option<Vec<usize>>,
    ) -> Result<ModelConfig> {
        let family = family_of(arch)?;
        let embd = llama::TOKEN_EMBD.name(BundleFormat::Gguf, 0);
        let mut c = dense_config_from_gguf(arch, Family::Other(family), RopeStyle::Neox, md, &embd, dims)?;
        let req = |k: &str| -> Result<usize> {
            let key = format!("{arch}.{k}");
            meta_usize(md, &key).ok_or_else(|| anyhow!("missing metadata key '{key}'"))
        };
        let experts = req("expert_count")?;
        let used = req("expert_used_count")?;
        // llama.cpp: the expert width may be one value or one per layer; without it, the dense
        // width over the experts used.
        let key = format!("{arch}.expert_feed_forward_length");
        let expert_ff = match md.get(&key) {
            None => c.intermediate_size / used.max(1),
            Some(Value::Array(a)) => {
                let v: Vec<usize> = a.iter().filter_map(|x| x.to_u32().ok().map(|x| x as usize)).collect();
                match v.first() {
                    Some(&f) if v.iter().all(|&x| x == f) => f,
                    _ => bail!("metadata '{key}': expert widths that differ by layer are not supported"),
                }
            }
            Some(_) => meta_usize(md, &key).ok_or_else(|| anyhow!("metadata '{key}' is not a count"))?,
        };
        let shared_key = format!("{arch}.expert_shared_feed_forward_length");
        let shared = (family == QWEN2MOE).then(|| meta_usize(md, &shared_key).unwrap_or(c.intermediate_size));
        if shared == Some(0) {
            bail!("metadata '{shared_key}' is 0: Qwen2-MoE has a shared expert");
        }
        // The layer count is the header's: before anything is built per layer, the weights must
        // hold its last layer (a huge `block_count` would otherwise loop and allocate per layer;
        // `check_layer_count` says the rest).
        let last = c
            .num_layers
            .checked_sub(1)
            .map(|l| llama::ATTN_NORM.name(BundleFormat::Gguf, l));
        if last.as_ref().is_none_or(|n| dims(n).is_none()) {
            bail!(
                "metadata '{arch}.block_count' = {}: the weights have no {}",
                c.num_layers,
                last.map_or("layers".to_string(), |n| format!("'{n}'"))
            );
        }
        // An MoE layer is one with a router (llama.cpp's qwen MoE files have one in every layer).
        let layers = (0..c.num_layers)
            .map(|l| dims(&ROUTER.name(BundleFormat::Gguf, l)).is_some())
            .collect();
        let moe = MoeConfig {
            experts,
            experts_per_token: used,
            expert_intermediate_size: expert_ff,
            shared_intermediate_size: shared,
            // llama.cpp's graphs: Qwen3-MoE renormalizes, Qwen2-MoE does not.
            norm_topk_prob: family == QWEN3MOE,
            layers,
        };
        check_moe(
            &moe,
            &format!("metadata '{arch}.expert_count'"),
            &format!("metadata '{arch}.expert_used_count'"),
            &format!("metadata '{arch}.expert_feed_forward_length'"),
        )?;
        c.moe = Some(moe);
        Ok(c)
    }

    fn config_from_hf(&self, model_type: &str, j: &Json) -> Result<ModelConfig> {
        let family = family_of(model_type)?;
        let mut c = dense_config_from_hf(Family::Other(family), j)?;
        let field = |k: &str| -> Result<usize> {
            llama::json_usize(j, k).ok_or_else(|| anyhow!("missing or non-integer field '{k}'"))
        };
        let mlp_only: Vec<usize> = match j.get("mlp_only_layers") {
            None | Some(Json::Null) => Vec::new(),
            Some(Json::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_u64()
                        .map(|x| x as usize)
                        .ok_or_else(|| anyhow!("field 'mlp_only_layers' holds {x}, not a layer number"))
                })
                .collect::<Result<_>>()?,
            Some(v) => bail!("field 'mlp_only_layers' is {v}, not a list of layer numbers"),
        };
        if let Some(&bad) = mlp_only.iter().find(|&&l| l >= c.num_layers) {
            bail!(
                "field 'mlp_only_layers' names layer {bad}, but the model has {} layers",
                c.num_layers
            );
        }
        let step = match j.get("decoder_sparse_step") {
            None | Some(Json::Null) => 1,
            Some(v) => match v.as_u64() {
                Some(s) if s >= 1 => s as usize,
                _ => bail!("field 'decoder_sparse_step' is {v}: a positive integer expected"),
            },
        };
        let shared = match family {
            QWEN2MOE => match field("shared_expert_intermediate_size")? {
                0 => bail!("field 'shared_expert_intermediate_size' is 0: Qwen2-MoE has a shared expert"),
                s => Some(s),
            },
            _ => None,
        };
        // transformers 5 writes Qwen3-MoE's expert count as `num_local_experts`.
        let (experts_key, experts) = match field("num_experts") {
            Ok(n) => ("num_experts", n),
            Err(_) => (
                "num_local_experts",
                field("num_local_experts")
                    .map_err(|_| anyhow!("missing or non-integer field 'num_experts' (or 'num_local_experts')"))?,
            ),
        };
        let norm_topk_prob = match j.get("norm_topk_prob") {
            None | Some(Json::Null) => false,
            Some(Json::Bool(b)) => *b,
            // transformers reads it as a Python truth value: 0 and 1 are accepted.
            Some(v) if v.as_u64() == Some(0) => false,
            Some(v) if v.as_u64() == Some(1) => true,
            Some(v) => bail!("field 'norm_topk_prob' is {v}: true or false expected"),
        };
        let moe = MoeConfig {
            experts,
            experts_per_token: field("num_experts_per_tok")?,
            expert_intermediate_size: field("moe_intermediate_size")?,
            shared_intermediate_size: shared,
            norm_topk_prob,
            layers: hf_moe_layers(c.num_layers, &mlp_only, step),
        };
        check_moe(
            &moe,
            &format!("field '{experts_key}'"),
            "field 'num_experts_per_tok'",
            "field 'moe_intermediate_size'",
        )?;
        c.moe = Some(moe);
        Ok(c)
    }

    fn tensors(&self) -> &'static [TensorSpec] {
        TENSORS
    }

    fn layer_tensors(&self, c: &ModelConfig, layer: usize) -> Vec<(&'static TensorSpec, bool)> {
        let qwen2 = is_qwen2(c);
        let moe = c.moe.as_ref();
        let is_moe = moe.is_some_and(|m| m.is_moe(layer));
        let shared = moe.is_some_and(|m| m.shared_intermediate_size.is_some());
        TENSORS
            .iter()
            .filter(|s| s.per_layer)
            .filter_map(|s| {
                let required = match s.role {
                    Role::AttnQBias | Role::AttnKBias | Role::AttnVBias => {
                        if !qwen2 {
                            return None;
                        }
                        true
                    }
                    Role::AttnQNorm | Role::AttnKNorm => {
                        if qwen2 {
                            return None;
                        }
                        true
                    }
                    Role::FfnGate | Role::FfnUp | Role::FfnDown => {
                        if is_moe {
                            return None;
                        }
                        true
                    }
                    Role::FfnRouter | Role::FfnGateExps | Role::FfnUpExps | Role::FfnDownExps => {
                        if !is_moe {
                            return None;
                        }
                        true
                    }
                    Role::FfnRouterShexp | Role::FfnGateShexp | Role::FfnUpShexp | Role::FfnDownShexp => {
                        if !(is_moe && shared) {
                            return None;
                        }
                        true
                    }
                    _ => s.required,
                };
                Some((s, required))
            })
            .collect()
    }

    fn layer_plan(&self, config: &ModelConfig) -> Vec<LayerPlan> {
        let qwen2 = is_qwen2(config);
        (0..config.num_layers)
            .map(|l| LayerPlan {
                attention: AttentionKind::Full,
                mlp: match &config.moe {
                    Some(m) if m.is_moe(l) && m.shared_intermediate_size.is_some() => MlpKind::MoeShared,
                    Some(m) if m.is_moe(l) => MlpKind::Moe,
                    _ => MlpKind::DenseSwiGlu,
                },
                qkv_bias: qwen2,
                qk_norm: !qwen2,
                parallel: false,
                post_norms: false,
            })
            .collect()
    }

    fn state_kind(&self) -> StateKind {
        StateKind::KvRows
    }

    /// Not yet: the CUDA MoE forward (`cuda/kernels.cu`, `moe_*`) is built and loads these
    /// bundles, but has not been run on a GPU; `specula bench --device cuda:N --shape
    /// qwen3-30b-a3b` checks it first.
    fn runs_on_cuda(&self) -> bool {
        false
    }

    fn build(&self, config: ModelConfig, w: &mut dyn WeightSource, device: &Device) -> Result<Model> {
        let moe = config
            .moe
            .clone()
            .ok_or_else(|| anyhow!("a Qwen MoE config without experts"))?;
        build_blocks(TENSORS, config, w, device, 0.0, &mut |w, l| {
            if moe.is_moe(l) {
                read_moe(w, &moe, l)
            } else {
                llama::dense_mlp(TENSORS, w, l)
            }
        })
    }

    fn gguf_metadata(&self, c: &ModelConfig) -> Vec<(String, Value)> {
        let arch = c.family.as_str();
        let mut md = dense_gguf_metadata(arch, c);
        if let Some(m) = &c.moe {
            let u = |x: usize| Value::U32(x as u32);
            md.push((format!("{arch}.expert_count"), u(m.experts)));
            md.push((format!("{arch}.expert_used_count"), u(m.experts_per_token)));
            md.push((
                format!("{arch}.expert_feed_forward_length"),
                u(m.expert_intermediate_size),
            ));
            if let Some(s) = m.shared_intermediate_size {
                md.push((format!("{arch}.expert_shared_feed_forward_length"), u(s)));
            }
        }
        md
    }

    fn hf_config(&self, c: &ModelConfig) -> Json {
        let model_type = if is_qwen2(c) { "qwen2_moe" } else { "qwen3_moe" };
        let mut j = dense_hf_config(model_type, c);
        if let Some(m) = &c.moe {
            j["num_experts"] = m.experts.into();
            j["num_experts_per_tok"] = m.experts_per_token.into();
            j["moe_intermediate_size"] = m.expert_intermediate_size.into();
            j["norm_topk_prob"] = m.norm_topk_prob.into();
            j["decoder_sparse_step"] = 1.into();
            let dense: Vec<usize> = (0..c.num_layers).filter(|&l| !m.is_moe(l)).collect();
            j["mlp_only_layers"] = dense.into();
            if let Some(s) = m.shared_intermediate_size {
                j["shared_expert_intermediate_size"] = s.into();
            }
        }
        j
    }
}

/// The name of `role`'s first row in the bundle's format at `layer` (a stacked GGUF tensor,
/// not a per-expert HF one).
fn tensor_name(w: &dyn WeightSource, role: Role, layer: usize) -> Result<String> {
    schema_name(TENSORS, role, w.format(), layer).ok_or_else(|| anyhow!("the tensor schema has no {role:?}"))
}

/// A tensor read as f32 values, checked to hold `len` of them.
fn f32_vec(w: &mut dyn WeightSource, name: &str, len: usize) -> Result<Vec<f32>> {
    let v = w.dense(name)?.flatten_all()?.to_vec1::<f32>()?;
    if v.len() != len {
        bail!("tensor '{name}' has {} values, expected {len}", v.len());
    }
    Ok(v)
}

/// The routed experts of `layer`: stacked (GGUF) or one tensor per expert (HF).
fn read_experts(w: &mut dyn WeightSource, moe: &MoeConfig, layer: usize) -> Result<Vec<GatedMlp>> {
    let n = moe.experts;
    let roles = [Role::FfnGateExps, Role::FfnUpExps, Role::FfnDownExps];
    let [gates, ups, downs]: [Vec<Linear>; 3] = if w.format() == BundleFormat::Gguf {
        let mut read = |r: Role| -> Result<Vec<Linear>> {
            let name = tensor_name(w, r, layer)?;
            w.experts(&name, n)
        };
        [read(roles[0])?, read(roles[1])?, read(roles[2])?]
    } else {
        // One tensor per expert (a bundle with transformers 5's fused experts is read as
        // those by the loader: `inspect::safetensors::split_fused_experts`).
        let spec = |r: Role| {
            TENSORS
                .iter()
                .find(|s| s.role == r && s.per_expert)
                .expect("per-expert rows")
        };
        let mut read = |r: Role| -> Result<Vec<Linear>> {
            (0..n)
                .map(|e| w.linear(&spec(r).expert_name(BundleFormat::Hf, layer, e), None))
                .collect()
        };
        [read(roles[0])?, read(roles[1])?, read(roles[2])?]
    };
    Ok(gates
        .into_iter()
        .zip(ups)
        .zip(downs)
        .map(|((gate, up), down)| GatedMlp { gate, up, down })
        .collect())
}

/// The MoE MLP of layer `l`: router, experts, and the shared expert when the config has one.
fn read_moe(w: &mut dyn WeightSource, moe: &MoeConfig, l: usize) -> Result<Mlp> {
    let router_name = tensor_name(w, Role::FfnRouter, l)?;
    let router = w.dense(&router_name)?;
    let d = router.dims().to_vec();
    if d.len() != 2 || d[0] != moe.experts {
        bail!(
            "tensor '{router_name}' has shape {d:?}, expected [{}, hidden]",
            moe.experts
        );
    }
    let hidden = d[1];
    let router = router.flatten_all()?.to_vec1::<f32>()?;
    let experts = read_experts(w, moe, l)?;
    let shared = match moe.shared_intermediate_size {
        None => None,
        Some(_) => {
            let mut lin = |r: Role| -> Result<Linear> {
                let n = tensor_name(w, r, l)?;
                w.linear(&n, None)
            };
            let expert = GatedMlp {
                gate: lin(Role::FfnGateShexp)?,
                up: lin(Role::FfnUpShexp)?,
                down: lin(Role::FfnDownShexp)?,
            };
            let gate_name = tensor_name(w, Role::FfnRouterShexp, l)?;
            Some(SharedExpert {
                expert,
                gate: f32_vec(w, &gate_name, hidden)?,
            })
        }
    };
    let mlp = MoeMlp::new(router, experts, shared, moe.experts_per_token, moe.norm_topk_prob)
        .map_err(|e| anyhow!("layer {l}: {e}"))?;
    Ok(Mlp::Moe(Box::new(mlp)))
}
