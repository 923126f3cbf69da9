//! Architectures: one file per model family, behind one trait and a registry.
//!
//! An architecture declares, in one place, everything the rest of Specula needs to know about a
//! model family:
//! - its config, read from GGUF metadata and from an HF `config.json` (one [`ModelConfig`], two
//!   readers: [`Architecture::config_from_gguf`], [`Architecture::config_from_hf`]);
//! - its tensor schema ([`Architecture::tensors`]): one table of names in both formats, shapes
//!   and roles, which the loaders, `inspect`, the memory estimate, the CUDA upload and the tiny
//!   test bundles all read, so no other module spells a tensor name;
//! - its layer plan ([`Architecture::layer_plan`]): per layer, the attention and MLP kinds;
//! - how its weights become a [`Model`] ([`Architecture::build`]).
//!
//! The registry ([`by_gguf`], [`by_hf`]) is keyed by GGUF `general.architecture` and HF
//! `model_type`. Adding a family is a new file here and one line in [`REGISTRY`]; see
//! `docs/architecture.md`.
//!
//! The layout follows llama.cpp's one name table (`LLM_TENSOR_*` in `llama-arch.cpp`, names
//! written `blk.N.<name>`) and transformers' checkpoint names (`model.layers.N.<name>`).

pub mod gemma3;
pub mod llama;
pub mod qwen_moe;

use std::collections::HashMap;

use anyhow::Result;
use candle_core::quantized::gguf_file::Value;
use candle_core::Tensor;
use serde_json::Value as Json;

use crate::model::{Embedding, LayerPass, Linear, Model};

pub use llama::Family;

/// How RoPE pairs the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs (x[2i], x[2i+1]): llama.cpp's "normal" mode, used by GGUF Llama files
    /// (whose q/k weights the converter permuted).
    Interleaved,
    /// Halves (x[i], x[i + d/2]): GPT-NeoX style, used by HF checkpoints and GGUF Qwen files.
    Neox,
}

/// Hyper-parameters of a model, as an architecture's config readers give them (the fields
/// every family has; a family with more adds them here, unused by the others).
#[derive(Debug, Clone, serde::Serialize)]
pub struct ModelConfig {
    pub family: Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// Context window in tokens.
    pub context_length: usize,
    #[serde(skip)]
    pub rope_style: RopeStyle,
    /// Sliding-window attention on some layers (Gemma 3); None: every layer attends to every
    /// earlier position.
    pub sliding_window: Option<SlidingWindow>,
    /// The factor queries are multiplied by after RoPE, replacing attention's `1/sqrt(head_dim)`
    /// (Gemma's `query_pre_attn_scalar^-1/2`, applied as llama.cpp does: the queries scaled, the
    /// scores not). None: the scores are scaled by `1/sqrt(head_dim)`.
    pub query_scale: Option<f64>,
    /// Linear RoPE scaling of the full-attention layers: the rotation angles multiplied by this
    /// (`1 / factor`; llama.cpp's `rope_freq_scale`). None: 1.
    pub rope_freq_scale: Option<f64>,
    /// Mixture-of-Experts MLPs on some layers (Qwen2-MoE, Qwen3-MoE); None: every MLP is dense
    /// of [`ModelConfig::intermediate_size`].
    pub moe: Option<MoeConfig>,
}

/// The routed experts of a Mixture-of-Experts model (Shazeer et al. 2017; Qwen2-MoE / Qwen3-MoE
/// as in transformers `modeling_qwen3_moe.py` and llama.cpp `build_moe_ffn`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct MoeConfig {
    /// Experts per MoE layer (`num_experts`; GGUF `expert_count`).
    pub experts: usize,
    /// Experts each token is routed to, top-k of the router's softmax (`num_experts_per_tok`;
    /// GGUF `expert_used_count`).
    pub experts_per_token: usize,
    /// The SwiGLU width of one expert (`moe_intermediate_size`; GGUF
    /// `expert_feed_forward_length`).
    pub expert_intermediate_size: usize,
    /// The width of the shared expert that every token also runs, scaled by a sigmoid gate
    /// (Qwen2-MoE's `shared_expert_intermediate_size`; GGUF
    /// `expert_shared_feed_forward_length`); None: no shared expert.
    pub shared_intermediate_size: Option<usize>,
    /// Whether the top-k routing weights are renormalized to sum to 1 (`norm_topk_prob`).
    pub norm_topk_prob: bool,
    /// Per layer, whether its MLP is the MoE (the others are dense of
    /// [`ModelConfig::intermediate_size`]: `mlp_only_layers`, `decoder_sparse_step`).
    pub layers: Vec<bool>,
}

impl MoeConfig {
    /// Whether layer `l` has the MoE MLP.
    pub fn is_moe(&self, l: usize) -> bool {
        self.layers.get(l).copied().unwrap_or(false)
    }
}

/// Which layers attend over a sliding window, how wide, and with which RoPE base.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SlidingWindow {
    /// Positions a windowed layer's query sees, its own included: keys `pos + 1 - size ..= pos`
    /// (llama.cpp's `LLAMA_SWA_TYPE_STANDARD`; transformers' `sliding_window`).
    pub size: usize,
    /// Per layer, whether it is windowed (the others attend to every earlier position).
    pub layers: Vec<bool>,
    /// The RoPE base of the windowed layers (the others use [`ModelConfig::rope_theta`]).
    pub rope_theta: f64,
}

impl ModelConfig {
    /// Weights one token's forward multiplies by in the transformer blocks, over all layers:
    /// the attention projections (q and o: `hidden × heads·head_dim` each; k and v:
    /// `hidden × kv_heads·head_dim` each) and the gated MLP's three (`hidden × intermediate`).
    /// A count of weights, not bytes. It is the work of a prompt token whose logits are not
    /// computed (prefill, a draft model's catch-up).
    /// On an MoE model, the weights of the experts a token is routed to (plus the router and
    /// the shared expert), not all experts ([`ModelConfig::total_block_params`]).
    pub fn block_params(&self) -> usize {
        self.block_params_by(true)
    }

    /// [`ModelConfig::block_params`] with every expert counted: the weights held in memory.
    pub fn total_block_params(&self) -> usize {
        self.block_params_by(false)
    }

    fn block_params_by(&self, active: bool) -> usize {
        let h = self.hidden_size;
        let q = self.num_heads * self.head_dim;
        let kv = self.num_kv_heads * self.head_dim;
        let attention = 2 * h * q + 2 * h * kv;
        (0..self.num_layers)
            .map(|l| attention + self.mlp_params(l, active))
            .sum()
    }

    /// The MLP weights of layer `l`: `3 × hidden × intermediate` for a dense one; for an MoE
    /// one the router (`experts × hidden`), the routed experts (the `experts_per_token` a token
    /// runs when `active`, else all) and the shared expert with its gate.
    pub fn mlp_params(&self, l: usize, active: bool) -> usize {
        let h = self.hidden_size;
        match &self.moe {
            Some(m) if m.is_moe(l) => {
                let routed = if active { m.experts_per_token } else { m.experts };
                let shared = m.shared_intermediate_size.map_or(0, |s| 3 * h * s + h);
                m.experts * h + routed * 3 * h * m.expert_intermediate_size + shared
            }
            _ => 3 * h * self.intermediate_size,
        }
    }

    /// [`ModelConfig::block_params`] plus the LM head (`vocab × hidden`): the weights a decode
    /// step reads.
    pub fn step_params(&self) -> usize {
        self.step_params_over(self.vocab_size)
    }

    /// [`ModelConfig::block_params`] plus an LM head of `logit_rows` rows (a drafter's reduced
    /// vocabulary, [`crate::model::Model::logit_rows`]).
    pub fn step_params_over(&self, logit_rows: usize) -> usize {
        self.block_params() + logit_rows * self.hidden_size
    }
}

/// The two bundle layouts, and so the two naming schemes of tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BundleFormat {
    /// One GGUF file (or a directory holding exactly one): names as llama.cpp writes them.
    Gguf,
    /// A Hugging Face directory: config.json + safetensors + tokenizer files; transformers' names.
    Hf,
}

impl BundleFormat {
    /// The prefix of layer `layer`'s tensor names: `blk.N.` (GGUF) or `model.layers.N.` (HF).
    pub fn layer_prefix(self, layer: usize) -> String {
        format!("{}{layer}.", self.layers_prefix())
    }

    /// The prefix every layer's tensor names share, before the layer number.
    pub fn layers_prefix(self) -> &'static str {
        match self {
            BundleFormat::Gguf => "blk.",
            BundleFormat::Hf => "model.layers.",
        }
    }

    /// `name` split into its layer number and the name within the layer
    /// (`blk.3.attn_q.weight` → `(3, "attn_q.weight")`); None for a name outside the layers.
    pub fn split_layer(self, name: &str) -> Option<(usize, &str)> {
        let rest = name.strip_prefix(self.layers_prefix())?;
        let (n, t) = rest.split_once('.')?;
        Some((n.parse().ok()?, t))
    }
}

/// Shapes of the usual tensors from a config, for [`TensorSpec::shape`] (outermost first,
/// `[out, in]` for a projection).
pub mod shape {
    use super::ModelConfig;

    /// `[hidden]`: a norm over the hidden size.
    pub fn hidden(c: &ModelConfig) -> Vec<usize> {
        vec![c.hidden_size]
    }
    /// `[vocab, hidden]`: the embedding, an LM head.
    pub fn vocab_by_hidden(c: &ModelConfig) -> Vec<usize> {
        vec![c.vocab_size, c.hidden_size]
    }
    /// `[heads × head_dim]`: the q bias.
    pub fn q_out(c: &ModelConfig) -> Vec<usize> {
        vec![c.num_heads * c.head_dim]
    }
    /// `[kv_heads × head_dim]`: the k and v biases.
    pub fn kv_out(c: &ModelConfig) -> Vec<usize> {
        vec![c.num_kv_heads * c.head_dim]
    }
    /// `[head_dim]`: a per-head norm.
    pub fn head_dim(c: &ModelConfig) -> Vec<usize> {
        vec![c.head_dim]
    }
    /// `[head_dim / 2]`: RoPE frequency factors.
    pub fn half_head_dim(c: &ModelConfig) -> Vec<usize> {
        vec![c.head_dim / 2]
    }
    /// `[heads × head_dim, hidden]`: the q projection.
    pub fn q_proj(c: &ModelConfig) -> Vec<usize> {
        vec![c.num_heads * c.head_dim, c.hidden_size]
    }
    /// `[kv_heads × head_dim, hidden]`: the k and v projections.
    pub fn kv_proj(c: &ModelConfig) -> Vec<usize> {
        vec![c.num_kv_heads * c.head_dim, c.hidden_size]
    }
    /// `[hidden, heads × head_dim]`: the attention output projection.
    pub fn o_proj(c: &ModelConfig) -> Vec<usize> {
        vec![c.hidden_size, c.num_heads * c.head_dim]
    }
    /// `[intermediate, hidden]`: the MLP gate and up projections.
    pub fn up_proj(c: &ModelConfig) -> Vec<usize> {
        vec![c.intermediate_size, c.hidden_size]
    }
    /// `[hidden, intermediate]`: the MLP down projection.
    pub fn down_proj(c: &ModelConfig) -> Vec<usize> {
        vec![c.hidden_size, c.intermediate_size]
    }

    fn moe(c: &ModelConfig) -> (usize, usize, usize) {
        c.moe.as_ref().map_or((0, 0, 0), |m| {
            (
                m.experts,
                m.expert_intermediate_size,
                m.shared_intermediate_size.unwrap_or(0),
            )
        })
    }
    /// `[experts, hidden]`: the MoE router.
    pub fn router(c: &ModelConfig) -> Vec<usize> {
        vec![moe(c).0, c.hidden_size]
    }
    /// `[experts, expert_intermediate, hidden]`: the experts' gate and up projections, stacked.
    pub fn experts_up(c: &ModelConfig) -> Vec<usize> {
        let (e, i, _) = moe(c);
        vec![e, i, c.hidden_size]
    }
    /// `[experts, hidden, expert_intermediate]`: the experts' down projections, stacked.
    pub fn experts_down(c: &ModelConfig) -> Vec<usize> {
        let (e, i, _) = moe(c);
        vec![e, c.hidden_size, i]
    }
    /// `[expert_intermediate, hidden]`: one expert's gate or up projection.
    pub fn expert_up(c: &ModelConfig) -> Vec<usize> {
        vec![moe(c).1, c.hidden_size]
    }
    /// `[hidden, expert_intermediate]`: one expert's down projection.
    pub fn expert_down(c: &ModelConfig) -> Vec<usize> {
        vec![c.hidden_size, moe(c).1]
    }
    /// `[shared_intermediate, hidden]`: the shared expert's gate or up projection.
    pub fn shared_up(c: &ModelConfig) -> Vec<usize> {
        vec![moe(c).2, c.hidden_size]
    }
    /// `[hidden, shared_intermediate]`: the shared expert's down projection.
    pub fn shared_down(c: &ModelConfig) -> Vec<usize> {
        vec![c.hidden_size, moe(c).2]
    }
    /// `[1, hidden]`: the shared expert's gate (HF `shared_expert_gate`, a 1-output linear).
    pub fn shared_gate_row(c: &ModelConfig) -> Vec<usize> {
        vec![1, c.hidden_size]
    }
}

/// What a tensor is for: the role the loader gives it, whatever its name in either format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// The token embedding table, `[vocab, hidden]`.
    TokenEmbedding,
    /// The final norm before the LM head, `[hidden]`.
    OutputNorm,
    /// The LM head, `[vocab, hidden]` (absent when tied to the embedding).
    Output,
    /// Per-frequency RoPE divisors (llama.cpp's `rope_freqs`, Llama 3.1 scaling), `[head_dim/2]`.
    RopeFreqs,
    /// The norm before attention, `[hidden]`.
    AttnNorm,
    /// Query, key, value and output projections (`[out, in]`), and the q/k/v biases.
    AttnQ,
    AttnK,
    AttnV,
    AttnOutput,
    AttnQBias,
    AttnKBias,
    AttnVBias,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3), `[head_dim]`.
    AttnQNorm,
    AttnKNorm,
    /// The norm of the attention's output before the residual add (Gemma), `[hidden]`.
    AttnPostNorm,
    /// The norm before the MLP, `[hidden]`.
    FfnNorm,
    /// The gated MLP's gate, up and down projections.
    FfnGate,
    FfnUp,
    FfnDown,
    /// The norm of the MLP's output before the residual add (Gemma), `[hidden]`.
    FfnPostNorm,
    /// The MoE router, `[experts, hidden]` (read as f32).
    FfnRouter,
    /// The routed experts' gate, up and down projections: stacked `[experts, out, in]` (GGUF)
    /// or one expert's `[out, in]` ([`TensorSpec::per_expert`], HF).
    FfnGateExps,
    FfnUpExps,
    FfnDownExps,
    /// The shared expert's gate, up and down projections.
    FfnGateShexp,
    FfnUpShexp,
    FfnDownShexp,
    /// The shared expert's sigmoid gate, one row of `hidden` (read as f32).
    FfnRouterShexp,
}

/// The shape class of a tensor, which says how it is stored and used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A weight matrix the forward multiplies by (kept quantized; counted in kernel coverage).
    Matrix,
    /// A row table read by index (the embedding; also an LM head when tied).
    Table,
    /// A vector: a norm weight, a bias, RoPE factors (read as f32).
    Vector,
}

/// One entry of an architecture's tensor schema.
#[derive(Debug, Clone, Copy)]
pub struct TensorSpec {
    pub role: Role,
    /// The GGUF name (after `blk.N.` for a per-layer tensor).
    pub gguf: &'static str,
    /// The HF name (after `model.layers.N.` for a per-layer tensor).
    pub hf: &'static str,
    /// Once per layer, or once per model.
    pub per_layer: bool,
    /// Whether a bundle without it is malformed; optional tensors switch a feature on (biases,
    /// QK-norm, an untied LM head).
    pub required: bool,
    pub kind: Kind,
    /// The expected shape, outermost first (`[out, in]` for a projection in both formats).
    pub shape: fn(&ModelConfig) -> Vec<usize>,
    /// One tensor per routed expert, its name holding `{e}` for the expert's number
    /// (`mlp.experts.{e}.gate_proj.weight`): [`TensorSpec::expert_name`].
    pub per_expert: bool,
}

impl TensorSpec {
    /// A schema row (a `const fn`, so schemas are static tables).
    pub const fn new(
        role: Role,
        gguf: &'static str,
        hf: &'static str,
        per_layer: bool,
        required: bool,
        kind: Kind,
        shape: fn(&ModelConfig) -> Vec<usize>,
    ) -> Self {
        Self {
            role,
            gguf,
            hf,
            per_layer,
            required,
            kind,
            shape,
            per_expert: false,
        }
    }

    /// This row, one tensor per routed expert (its names hold `{e}`).
    pub const fn experts(self) -> Self {
        Self {
            per_expert: true,
            ..self
        }
    }

    /// The name of expert `e`'s tensor of a per-expert row (`{e}` replaced).
    pub fn expert_name(&self, format: BundleFormat, layer: usize, e: usize) -> String {
        self.name(format, layer).replace("{e}", &e.to_string())
    }

    /// The full name in `format`; `layer` is used only for a per-layer tensor.
    pub fn name(&self, format: BundleFormat, layer: usize) -> String {
        let base = self.base(format);
        if self.per_layer {
            format!("{}{base}", format.layer_prefix(layer))
        } else {
            base.to_string()
        }
    }

    /// The name in `format` without the layer prefix.
    pub fn base(&self, format: BundleFormat) -> &'static str {
        match format {
            BundleFormat::Gguf => self.gguf,
            BundleFormat::Hf => self.hf,
        }
    }
}

/// One tensor a bundle of a config holds: its full name, its schema row, and whether a bundle
/// without it is malformed (for that layer of that config: [`Architecture::layer_tensors`]).
#[derive(Debug, Clone)]
pub struct Expected {
    pub name: String,
    pub spec: &'static TensorSpec,
    pub required: bool,
}

/// A model's tensors as `arch`'s schema names them in `format` for config `c` (per layer by
/// [`Architecture::layer_tensors`]; a per-expert row once per expert), in order: the list a
/// loader takes and `inspect` checks.
pub fn expected_tensors(arch: &dyn Architecture, c: &ModelConfig, format: BundleFormat) -> Vec<Expected> {
    let named = |s: &TensorSpec| !s.base(format).is_empty();
    let globals: Vec<&'static TensorSpec> = arch.tensors().iter().filter(|s| !s.per_layer && named(s)).collect();
    let mut out = Vec::new();
    for s in globals.iter().filter(|s| s.role == Role::TokenEmbedding) {
        out.push(Expected {
            name: s.name(format, 0),
            spec: s,
            required: s.required,
        });
    }
    let experts = c.moe.as_ref().map_or(0, |m| m.experts);
    for l in 0..c.num_layers {
        for (s, required) in arch.layer_tensors(c, l).into_iter().filter(|(s, _)| named(s)) {
            if s.per_expert {
                for e in 0..experts {
                    out.push(Expected {
                        name: s.expert_name(format, l, e),
                        spec: s,
                        required,
                    });
                }
            } else {
                out.push(Expected {
                    name: s.name(format, l),
                    spec: s,
                    required,
                });
            }
        }
    }
    for s in globals.iter().filter(|s| s.role != Role::TokenEmbedding) {
        out.push(Expected {
            name: s.name(format, 0),
            spec: s,
            required: s.required,
        });
    }
    out
}

/// The name of `name` (in format `from`) in format `to`, by the schema; None for a name the
/// schema does not hold, or holds in one format only.
pub fn rename(schema: &[TensorSpec], name: &str, from: BundleFormat, to: BundleFormat) -> Option<String> {
    let known = |s: &&TensorSpec| !s.base(from).is_empty() && !s.base(to).is_empty();
    if let Some((layer, base)) = from.split_layer(name) {
        let s = schema
            .iter()
            .filter(known)
            .find(|s| s.per_layer && s.base(from) == base)?;
        return Some(s.name(to, layer));
    }
    let s = schema
        .iter()
        .filter(known)
        .find(|s| !s.per_layer && s.base(from) == name)?;
    Some(s.name(to, 0))
}

/// Check a config's layer count against the tensors a bundle holds (`has`, by full name): the
/// last layer's first required per-layer tensor must be there. Run before anything loops over
/// the layers, so an absurd count (a header saying 2^40 layers over weights of 2) is an error at
/// once instead of a long loop or a huge allocation. In a GGUF file that tensor must not exist
/// for the layer past the count either (llama.cpp refuses tensors it does not use: a
/// `block_count` one short would run a truncated model). HF bundles may hold more (an MTP layer
/// numbered after the last block). Errors name the count and the tensor.
pub fn check_layer_count(
    a: &dyn Architecture,
    config: &ModelConfig,
    format: BundleFormat,
    has: &dyn Fn(&str) -> bool,
) -> Result<()> {
    let Some(spec) = a
        .tensors()
        .iter()
        .find(|s| s.per_layer && s.required && !s.base(format).is_empty())
    else {
        return Ok(());
    };
    if config.num_layers == 0 {
        anyhow::bail!("the config has no layers");
    }
    let name = spec.name(format, config.num_layers - 1);
    if !has(&name) {
        anyhow::bail!(
            "the config has {} layers, but the weights have no '{name}' (a layer count the weights do not hold)",
            config.num_layers
        );
    }
    let past = spec.name(format, config.num_layers);
    if format == BundleFormat::Gguf && has(&past) {
        anyhow::bail!(
            "the config has {} layers, but the file also holds '{past}' (a layer count short of the file's layers)",
            config.num_layers
        );
    }
    Ok(())
}

/// The spec of `role` in `schema`. Panics when the schema lacks it: a schema is a constant
/// table, so that is a programming error caught by the registry's tests.
pub fn spec(schema: &'static [TensorSpec], role: Role) -> &'static TensorSpec {
    schema
        .iter()
        .find(|s| s.role == role)
        .unwrap_or_else(|| panic!("the tensor schema has no {role:?}"))
}

/// How one layer attends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AttentionKind {
    /// Causal attention over every earlier position (the state is KV rows).
    Full,
    /// Causal attention over the last `window` positions, the query's own included, with the
    /// windowed RoPE base ([`SlidingWindow`]).
    Sliding { window: usize },
}

/// The MLP of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MlpKind {
    /// `down(silu(gate(x)) * up(x))` (SwiGLU; Shazeer 2020).
    DenseSwiGlu,
    /// `down(gelu_tanh(gate(x)) * up(x))` (GeGLU; Shazeer 2020), Gemma's MLP.
    DenseGeGlu,
    /// Routed SwiGLU experts: each token runs the top-k experts of the router's softmax and sums
    /// their outputs weighted by the routing probabilities ([`MoeConfig`]).
    Moe,
    /// [`MlpKind::Moe`] plus a shared SwiGLU expert every token runs, scaled by
    /// `sigmoid(gate · x)` (Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE).
    MoeShared,
}

/// The plan of one layer: what the forward runs there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct LayerPlan {
    pub attention: AttentionKind,
    pub mlp: MlpKind,
    /// q, k and v projections carry biases (Qwen2).
    pub qkv_bias: bool,
    /// Per-head RMSNorm on q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Attention and MLP read one norm of the same input and both add to the residual
    /// (GPT-J, Falcon), instead of the MLP following the attention.
    pub parallel: bool,
    /// The attention's and the MLP's outputs are normed before their residual adds (Gemma 2/3's
    /// sandwich norms).
    pub post_norms: bool,
}

/// What a sequence carries between steps, and so how it rolls back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StateKind {
    /// Keys and values per position: rollback drops the rows past the kept length.
    KvRows,
}

/// Where a source of weights gets its tensors (a GGUF file, safetensors files): what an
/// architecture's [`Architecture::build`] reads from. Errors name the file and the tensor.
pub trait WeightSource {
    /// The layout the names follow.
    fn format(&self) -> BundleFormat;
    /// Whether the bundle holds `name`.
    fn has(&self, name: &str) -> bool;
    /// A weight matrix `[out, in]` with an optional bias `[out]`, kept in its stored type where
    /// Specula's kernels run it.
    fn linear(&mut self, weight: &str, bias: Option<&str>) -> Result<Linear>;
    /// A row table (the embedding).
    fn table(&mut self, name: &str) -> Result<Embedding>;
    /// A vector or small tensor as dense f32.
    fn dense(&mut self, name: &str) -> Result<Tensor>;
    /// The `count` experts of a stacked `[count, out, in]` tensor as one linear layer each, in
    /// order (the default expands the tensor to f32; a quantized source keeps each expert's
    /// blocks as stored). Errors: the tensor is missing or not `count` deep.
    fn experts(&mut self, name: &str, count: usize) -> Result<Vec<Linear>> {
        let t = self.dense(name)?;
        let dims = t.dims().to_vec();
        if dims.len() != 3 || dims[0] != count {
            anyhow::bail!("tensor '{name}' has shape {dims:?}, expected [{count}, out, in]");
        }
        (0..count).map(|e| Linear::from_dense(t.get(e)?, None)).collect()
    }
}

/// A model family. Implementations are unit structs in this module's files, listed in
/// [`REGISTRY`].
pub trait Architecture: Send + Sync + std::fmt::Debug {
    /// The family's name as `inspect` shows it.
    fn name(&self) -> &'static str;
    /// The GGUF `general.architecture` values this file reads.
    fn gguf_names(&self) -> &'static [&'static str];
    /// The HF `model_type` values this file reads.
    fn hf_model_types(&self) -> &'static [&'static str];
    /// Names among those accepted that error messages do not list (a second name for the same
    /// layout, such as `mistral` for `llama`).
    fn aliases(&self) -> &'static [&'static str] {
        &[]
    }
    /// The GGUF metadata keys (after `{arch}.`) without which no config can be read.
    fn gguf_required_keys(&self) -> &'static [&'static str];
    /// The `config.json` fields without which no config can be read.
    fn hf_required_fields(&self) -> &'static [&'static str];
    /// The config from GGUF metadata; `dims` gives a tensor's shape by name (some values, such
    /// as the vocabulary, are read from the tensor directory). Errors name the key.
    fn config_from_gguf(
        &self,
        arch: &str,
        md: &HashMap<String, Value>,
        dims: &dyn Fn(&str) -> Option<Vec<usize>>,
    ) -> Result<ModelConfig>;
    /// The config from `config.json` (`c` is its text part: `text_config` when present).
    /// Errors name the field.
    fn config_from_hf(&self, model_type: &str, c: &Json) -> Result<ModelConfig>;
    /// The tensor schema.
    fn tensors(&self) -> &'static [TensorSpec];
    /// The per-layer rows of the schema a bundle of config `c` holds at layer `layer`, each with
    /// whether it is required there (a family whose layers differ, such as dense and MoE MLPs,
    /// says which). The default: every per-layer row, required as the schema says.
    fn layer_tensors(&self, _c: &ModelConfig, _layer: usize) -> Vec<(&'static TensorSpec, bool)> {
        self.tensors()
            .iter()
            .filter(|s| s.per_layer)
            .map(|s| (s, s.required))
            .collect()
    }
    /// Per layer, what the forward runs.
    fn layer_plan(&self, config: &ModelConfig) -> Vec<LayerPlan>;
    /// What a sequence's state is.
    fn state_kind(&self) -> StateKind;
    /// Read the weights into a model. Errors name the file and tensor (from `w`) or the
    /// inconsistency.
    fn build(&self, config: ModelConfig, w: &mut dyn WeightSource, device: &candle_core::Device) -> Result<Model>;
    /// One layer of the forward pass: the residual stream `x` (`[rows, hidden]` f32, rows of
    /// every segment stacked) updated in place from the layer's weights, with the operations
    /// of [`LayerPass`] (each row-independent, so the layer is batch-invariant when they are).
    /// The default is the pre-norm block: `x += attn(norm(x)); x += mlp(norm(x))`.
    fn layer_forward(&self, layer: &mut LayerPass<'_, '_, '_>, x: &mut [f32]) -> Result<()> {
        layer.pre_norm_block(x)
    }
    /// The factor the token embeddings are multiplied by before the first layer (Gemma:
    /// `sqrt(hidden)`, rounded to f32); None for none.
    fn embedding_scale(&self, _config: &ModelConfig) -> Option<f32> {
        None
    }
    /// Whether the CUDA backend serves this architecture (`--device cuda:N`): its forward has
    /// the kernels and has been checked on a GPU against the CPU.
    fn runs_on_cuda(&self) -> bool {
        false
    }
    /// The GGUF metadata that [`Architecture::config_from_gguf`] reads back as `c` (with the
    /// tensor directory): for writing bundles (tests, tools).
    fn gguf_metadata(&self, c: &ModelConfig) -> Vec<(String, Value)>;
    /// The `config.json` that [`Architecture::config_from_hf`] reads back as `c`.
    fn hf_config(&self, c: &ModelConfig) -> Json;
}

/// The architectures built in.
pub static REGISTRY: &[&dyn Architecture] = &[&llama::Llama, &gemma3::Gemma3, &qwen_moe::QwenMoe];

/// Architectures added at run time ([`register`]).
static REGISTERED: std::sync::RwLock<Vec<&'static dyn Architecture>> = std::sync::RwLock::new(Vec::new());

/// Add an architecture to the registry (a family defined outside this module, e.g. in a test).
/// Errors: one of its GGUF or HF names is already taken.
pub fn register(a: &'static dyn Architecture) -> Result<()> {
    let mut extra = REGISTERED.write().unwrap_or_else(|e| e.into_inner());
    if extra.iter().any(|b| std::ptr::addr_eq(*b, a)) {
        return Ok(());
    }
    // Checked under the write lock (so two registrations cannot both pass), against the list
    // it guards.
    let known: Vec<&'static dyn Architecture> = REGISTRY.iter().chain(extra.iter()).copied().collect();
    for n in a.gguf_names() {
        if known.iter().any(|b| b.gguf_names().contains(n)) {
            anyhow::bail!("the GGUF architecture name '{n}' is already registered");
        }
    }
    for n in a.hf_model_types() {
        if known.iter().any(|b| b.hf_model_types().contains(n)) {
            anyhow::bail!("the HF model_type '{n}' is already registered");
        }
    }
    extra.push(a);
    Ok(())
}

/// Every architecture Specula runs: the built-in ones, then those registered.
pub fn all() -> Vec<&'static dyn Architecture> {
    let mut v: Vec<&'static dyn Architecture> = REGISTRY.to_vec();
    // A poisoned lock still holds a valid list (pushes are the only writes).
    v.extend(REGISTERED.read().unwrap_or_else(|e| e.into_inner()).iter().copied());
    v
}

/// The architecture of a GGUF `general.architecture` value.
pub fn by_gguf(name: &str) -> Option<&'static dyn Architecture> {
    all().into_iter().find(|a| a.gguf_names().contains(&name))
}

/// The architecture of an HF `model_type` value.
pub fn by_hf(model_type: &str) -> Option<&'static dyn Architecture> {
    all().into_iter().find(|a| a.hf_model_types().contains(&model_type))
}

/// The architecture of a parsed config (by its [`Family`]); None for a family no registered
/// architecture reads.
pub fn try_of(config: &ModelConfig) -> Option<&'static dyn Architecture> {
    let name = config.family.as_str();
    all()
        .into_iter()
        .find(|a| a.name() == name || a.gguf_names().contains(&name))
}

/// [`try_of`] for a config an architecture produced. Panics when none reads it, which only a
/// hand-built config naming an unregistered family can cause.
pub fn of(config: &ModelConfig) -> &'static dyn Architecture {
    try_of(config).unwrap_or_else(|| panic!("no registered architecture reads family '{}'", config.family.as_str()))
}

/// The names a user may give, for error messages: "llama, qwen2, qwen3".
pub fn supported(format: BundleFormat) -> String {
    let mut names: Vec<&str> = Vec::new();
    for a in all() {
        let list = match format {
            BundleFormat::Gguf => a.gguf_names(),
            BundleFormat::Hf => a.hf_model_types(),
        };
        names.extend(list.iter().filter(|n| !a.aliases().contains(n)));
    }
    names.join(", ")
}
