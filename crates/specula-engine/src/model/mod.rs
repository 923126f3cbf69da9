//! The forward pass of dense decoder-only transformers (the blocks [`crate::arch`] declares):
//! Llama, Qwen2 and Qwen3 in one parameterised implementation.
//!
//! Reference: the Llama architecture (Touvron et al. 2023) as implemented by llama.cpp
//! (`src/models/llama.cpp`, `qwen2.cpp`, `qwen3.cpp`) and Hugging Face transformers
//! (`modeling_llama.py`, `modeling_qwen2.py`, `modeling_qwen3.py`): pre-norm blocks of
//! RMSNorm → grouped-query attention with RoPE → residual → RMSNorm → SwiGLU MLP → residual.
//! Qwen2 adds biases to the q/k/v projections; Qwen3 adds a per-head RMSNorm on q and k
//! before RoPE.
//!
//! Unlike candle-transformers' models, [`Model::forward`] returns logits for every requested row
//! (verify passes need all k+1 rows), can return the hidden states of chosen layers (for MTP and
//! block drafters), and keeps its KV cache in a [`KvCache`] that can be truncated (rollback).
//! Attention is computed by our own row-independent kernel ([`attention`]), so a row's result
//! does not depend on how many rows are computed with it.
//!
//! The element-wise and row-wise operations (RMSNorm, RoPE, SwiGLU, the f16 K/V cache, attention)
//! use llama.cpp's CPU arithmetic operation for operation (ggml-cpu `rms_norm`, `rope`,
//! `swiglu`, `flash_attn_ext`), so that with the same quantized products our logits are llama.cpp's
//! bit for bit (docs/perf.md, "Reference agreement").

pub mod attention;
pub mod moe;

use std::sync::Arc;

use anyhow::{bail, Result};
use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};

use crate::kernels::kquants::KWeight;
use crate::kernels::qmatmul::QWeight;
use crate::kv_cache::KvCache;

/// RMSNorm as ggml's CPU `rms_norm` followed by `mul` computes it: the sum of squares (each
/// square rounded to f32) accumulated in f64 in order, `mean` rounded to f32,
/// `scale = 1 / sqrtf(mean + eps)` in f32, then `(x * scale) * w`. Row by row, so
/// batch-invariant. `x`: rows of `w.len()` values, row-major; returns the same shape.
fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    // Rows in groups of RMS_GROUP: each row's sum of squares is the same sequential f64 chain
    // (the bits of the one-row loop, [`rms_norm_row`]), and a group runs its rows' chains side
    // by side, so their add latencies overlap instead of queueing.
    const G: usize = RMS_GROUP;
    let h = w.len();
    let mut out = vec![0f32; x.len()];
    if h == 0 {
        return out;
    }
    for (rows, outs) in x.chunks(G * h).zip(out.chunks_mut(G * h)) {
        let n = rows.len() / h;
        let mut sums = [0f64; G];
        if n == G {
            let r: [&[f32]; G] = std::array::from_fn(|i| &rows[i * h..(i + 1) * h]);
            // One index walks the G rows together (an iterator per row would not keep the
            // G chains in one loop body).
            #[allow(clippy::needless_range_loop)]
            for j in 0..h {
                for i in 0..G {
                    let v = r[i][j];
                    sums[i] += (v * v) as f64;
                }
            }
        } else {
            for (i, row) in rows.chunks_exact(h).enumerate() {
                for &v in row {
                    sums[i] += (v * v) as f64;
                }
            }
        }
        for ((row, o), &sum) in rows.chunks_exact(h).zip(outs.chunks_exact_mut(h)).zip(&sums) {
            let mean = (sum / h as f64) as f32;
            let scale = 1.0f32 / (mean + eps).sqrt();
            for ((o, &v), &wv) in o.iter_mut().zip(row).zip(w) {
                *o = v * scale * wv;
            }
        }
    }
    out
}

/// Rows whose RMSNorm sums [`rms_norm`] interleaves.
const RMS_GROUP: usize = 8;

/// RMSNorm of one row, as ggml computes it (`ggml_compute_forward_rms_norm_f32`: the squares
/// summed in order in double precision, `x * (1 / sqrt(mean + eps)) * w` in f32): the
/// definition [`rms_norm`] must match bit for bit.
#[cfg(test)]
fn rms_norm_row(row: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut sum = 0f64;
    for &v in row {
        sum += (v * v) as f64;
    }
    let mean = (sum / w.len() as f64) as f32;
    let scale = 1.0f32 / (mean + eps).sqrt();
    row.iter().zip(w).map(|(&v, &wv)| v * scale * wv).collect()
}

/// `x += y`, element by element (the residual adds).
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// A tensor's values as f32, flattened.
fn f32_values(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

pub use crate::arch::{Family, ModelConfig, RopeStyle};

/// The weight of a [`Linear`]: our batch-invariant kernels for the 32-wide ggml block types
/// ([`QWeight`]) and the K-quants ([`KWeight`]), candle's `QMatMul` for the rest (dense f32, and
/// K-quant tensors whose input width is not a multiple of 256).
#[derive(Debug, Clone)]
enum Weight {
    Own(QWeight),
    OwnK(KWeight),
    Candle(QMatMul),
}

/// `SPECULA_KQUANTS=candle` keeps K-quant weights on candle's `QMatMul` (not batch-invariant, so
/// speculation falls back to AR): a switch for side-by-side speed comparisons only.
fn kquants_on_candle() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SPECULA_KQUANTS").is_ok_and(|v| v == "candle"))
}

/// A linear layer `y = x W^T (+ b)`, `W` of shape `[out, in]`.
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Weight,
    bias: Option<Tensor>,
    /// `bias` as f32 values, for [`Linear::forward_rows`].
    bias_values: Option<Vec<f32>>,
}

impl Linear {
    /// From a GGUF tensor: quantized types stay quantized (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 in
    /// [`QWeight`], Q2_K..Q6_K in [`KWeight`]); F32/F16/BF16 are expanded to f32 for candle.
    pub fn from_qtensor(w: Arc<QTensor>, bias: Option<Tensor>) -> Result<Self> {
        let own_k = if kquants_on_candle() {
            None
        } else {
            KWeight::from_qtensor(&w)?
        };
        let weight = if let Some(q) = QWeight::from_qtensor(&w)? {
            Weight::Own(q)
        } else if let Some(k) = own_k {
            Weight::OwnK(k)
        } else {
            Weight::Candle(QMatMul::from_arc(w)?)
        };
        Self::with_bias(weight, bias)
    }

    fn with_bias(weight: Weight, bias: Option<Tensor>) -> Result<Self> {
        let bias = bias.map(|b| b.to_dtype(DType::F32)).transpose()?;
        let bias_values = bias.as_ref().map(f32_values).transpose()?;
        Ok(Self {
            weight,
            bias,
            bias_values,
        })
    }

    /// From a dense `[out, in]` tensor (converted to f32).
    pub fn from_dense(w: Tensor, bias: Option<Tensor>) -> Result<Self> {
        Self::with_bias(Weight::Candle(QMatMul::Tensor(w.to_dtype(DType::F32)?)), bias)
    }

    /// The output features `ids` (rows of `W`, in that order) as a new layer: each output is
    /// bitwise what this layer gives at that feature. None for weights on candle's path.
    pub fn select_rows(&self, ids: &[u32]) -> Option<Self> {
        let weight = match &self.weight {
            Weight::Own(q) => Weight::Own(q.select_rows(ids)),
            Weight::OwnK(q) => Weight::OwnK(q.select_rows(ids)),
            Weight::Candle(_) => return None,
        };
        let bias_values = self
            .bias_values
            .as_ref()
            .map(|b| ids.iter().map(|&j| b[j as usize]).collect::<Vec<f32>>());
        let bias = match &bias_values {
            Some(b) => Some(Tensor::from_slice(b, b.len(), &Device::Cpu).ok()?),
            None => None,
        };
        Some(Self {
            weight,
            bias,
            bias_values,
        })
    }

    /// Is row i of an n-row product bitwise equal to the 1-row product? True for our own
    /// kernels; false for candle's dense path (see DESIGN.md).
    pub fn is_batch_invariant(&self) -> bool {
        matches!(self.weight, Weight::Own(_) | Weight::OwnK(_))
    }

    /// `x`: `m` rows of `in` f32 values, row-major → `m` rows of `out` (our kernels without
    /// tensor round trips; candle's for the other weight types).
    pub fn forward_rows(&self, x: &[f32], m: usize) -> Result<Vec<f32>> {
        let mut y = match &self.weight {
            Weight::Own(q) => q.matmul(x, m),
            Weight::OwnK(q) => q.matmul(x, m),
            Weight::Candle(_) => {
                let k = x.len() / m.max(1);
                let t = Tensor::from_slice(x, (m, k), &Device::Cpu)?;
                return Ok(self.forward(&t)?.flatten_all()?.to_vec1::<f32>()?);
            }
        };
        self.add_bias(&mut y);
        Ok(y)
    }

    /// [`Linear::forward_rows`] of several layers on the same input (a block's q, k and v, or
    /// its gate and up): `x` is `m` rows of their common input width; returns each layer's `m`
    /// rows of its outputs, in order. The products on our kernels share one parallel pass
    /// (one fork-join of the kernel pool instead of one each); the bits are each layer's own.
    pub fn forward_rows_many(layers: &[&Linear], x: &[f32], m: usize) -> Result<Vec<Vec<f32>>> {
        let own = |l: &&Linear| matches!(l.weight, Weight::Own(_) | Weight::OwnK(_));
        if !layers.iter().all(own) {
            return layers.iter().map(|l| l.forward_rows(x, m)).collect();
        }
        // The 32-wide products share one quantization of the input.
        let shared = m > 0 && layers.iter().filter(|l| matches!(l.weight, Weight::Own(_))).count() > 1;
        let rows = if shared {
            crate::kernels::qmatmul::quantize_rows(x, x.len() / m.max(1))
        } else {
            Vec::new()
        };
        let jobs: Vec<_> = layers
            .iter()
            .map(|l| match &l.weight {
                Weight::Own(q) if shared => q.job_quantized(&rows),
                Weight::Own(q) => q.job(x, m),
                Weight::OwnK(q) => q.job(x, m),
                Weight::Candle(_) => unreachable!("checked above"),
            })
            .collect();
        let mut ys = crate::kernels::run_jobs(&jobs);
        for (y, l) in ys.iter_mut().zip(layers) {
            l.add_bias(y);
        }
        Ok(ys)
    }

    /// Products of several layers, each on its own input: `items` are (layer, `m` rows of its
    /// input width, `m`); returns each layer's `m` rows of outputs, in order (an MoE's experts,
    /// each on the rows routed to it). On our kernels they share one parallel pass; the bits
    /// are each product's own.
    pub fn forward_rows_each(items: &[(&Linear, &[f32], usize)]) -> Result<Vec<Vec<f32>>> {
        if !items.iter().all(|(l, _, _)| l.is_batch_invariant()) {
            return items.iter().map(|(l, x, m)| l.forward_rows(x, *m)).collect();
        }
        let jobs: Vec<_> = items
            .iter()
            .map(|(l, x, m)| match &l.weight {
                Weight::Own(q) => q.job(x, *m),
                Weight::OwnK(q) => q.job(x, *m),
                Weight::Candle(_) => unreachable!("checked above"),
            })
            .collect();
        let mut ys = crate::kernels::run_jobs(&jobs);
        for (y, (l, _, _)) in ys.iter_mut().zip(items) {
            l.add_bias(y);
        }
        Ok(ys)
    }

    fn add_bias(&self, y: &mut [f32]) {
        if let Some(b) = &self.bias_values {
            for row in y.chunks_exact_mut(b.len()) {
                add_assign(row, b);
            }
        }
    }

    /// `x`: `[n, in]` f32 → `[n, out]` f32.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = match &self.weight {
            Weight::Own(q) => {
                let (m, _) = x.dims2()?;
                let xs = x.flatten_all()?.to_vec1::<f32>()?;
                let y = q.matmul(&xs, m);
                Tensor::from_vec(y, (m, q.dims().0), x.device())?
            }
            Weight::OwnK(q) => {
                let (m, _) = x.dims2()?;
                let xs = x.flatten_all()?.to_vec1::<f32>()?;
                let y = q.matmul(&xs, m);
                Tensor::from_vec(y, (m, q.dims().0), x.device())?
            }
            Weight::Candle(w) => w.forward(x)?,
        };
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

/// The token embedding table, quantized (GGUF) or dense (HF).
#[derive(Debug, Clone)]
pub enum Embedding {
    Quantized(Arc<QTensor>),
    Dense(Tensor),
}

impl Embedding {
    /// The table as a linear layer (an LM head: a tied one reads the embedding's rows), kept
    /// quantized where Specula's kernels run its type.
    pub fn to_linear(&self) -> Result<Linear> {
        match self {
            Embedding::Quantized(q) => Linear::from_qtensor(q.clone(), None),
            Embedding::Dense(t) => Linear::from_dense(t.clone(), None),
        }
    }

    /// `ids` → `[n, hidden]` f32.
    pub fn forward(&self, ids: &[u32], device: &Device) -> Result<Tensor> {
        let t = Tensor::new(ids, device)?;
        Ok(match self {
            Embedding::Quantized(q) => q.embedding(&t)?,
            Embedding::Dense(w) => w.index_select(&t, 0)?,
        })
    }
}

/// A gated MLP's projections, `down(act(gate(x)) * up(x))`: a dense MLP, or one expert of an
/// MoE.
#[derive(Debug, Clone)]
pub struct GatedMlp {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

impl GatedMlp {
    /// Whether its three products run on batch-invariant kernels.
    pub fn is_batch_invariant(&self) -> bool {
        [&self.gate, &self.up, &self.down]
            .iter()
            .all(|l| l.is_batch_invariant())
    }
}

/// A block's MLP weights, by [`crate::arch::MlpKind`].
#[derive(Debug, Clone)]
pub enum Mlp {
    Dense(Box<GatedMlp>),
    Moe(Box<moe::MoeMlp>),
}

impl Mlp {
    /// A dense MLP of `gate`, `up` and `down`.
    pub fn dense(gate: Linear, up: Linear, down: Linear) -> Self {
        Mlp::Dense(Box::new(GatedMlp { gate, up, down }))
    }

    fn is_batch_invariant(&self) -> bool {
        match self {
            Mlp::Dense(m) => m.is_batch_invariant(),
            Mlp::Moe(m) => m.is_batch_invariant(),
        }
    }
}

/// One transformer block's weights.
#[derive(Debug, Clone)]
pub struct Block {
    pub attn_norm: Tensor,
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    /// Qwen3 per-head RMSNorm weights, `[head_dim]`.
    pub q_norm: Option<Tensor>,
    pub k_norm: Option<Tensor>,
    /// The norm before the MLP; None in blocks whose MLP reads the attention's norm (parallel
    /// attention and MLP).
    pub ffn_norm: Option<Tensor>,
    pub mlp: Mlp,
    /// The norms of the attention's and the MLP's outputs before their residual adds (Gemma);
    /// None in blocks without them.
    pub post_attn_norm: Option<Tensor>,
    pub post_ffn_norm: Option<Tensor>,
}

/// Which rows of a forward pass need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsRows {
    /// Every input row (verify passes, teacher forcing).
    All,
    /// Only the last row (prefill, plain decode).
    Last,
    /// No logits (prefill chunks before the last).
    None,
}

/// One sequence's part of a batched forward pass ([`Model::forward_batch`]): its new tokens,
/// its KV cache (the tokens go at positions `kv.len() ..`), and which rows need logits.
#[derive(Debug)]
pub struct Segment<'a> {
    pub tokens: &'a [u32],
    pub kv: &'a mut KvCache,
    pub rows: LogitsRows,
}

/// What a forward pass returns.
#[derive(Debug)]
pub struct ForwardOutput {
    /// `[rows, vocab]` f32 logits for the rows asked for (`rows` = n, 1 or 0).
    pub logits: Tensor,
    /// Hidden states after the requested blocks, in the order asked: each `[n, hidden]` f32, the
    /// residual stream leaving block `i` (0-based; `num_layers` means after the final norm).
    pub hidden: Vec<Tensor>,
}

/// A loaded dense model.
#[derive(Debug)]
pub struct Model {
    pub config: ModelConfig,
    /// The architecture whose layers this model runs ([`crate::arch::Architecture::layer_forward`]).
    arch: &'static dyn crate::arch::Architecture,
    pub embedding: Embedding,
    pub blocks: Vec<Block>,
    pub output_norm: Tensor,
    pub lm_head: Linear,
    /// RoPE tables `[context, head_dim / 2]` (f32), computed once: for the full-attention
    /// layers, and for the windowed ones when their base differs ([`crate::arch::SlidingWindow`]).
    rope: RopeTable,
    rope_local: Option<RopeTable>,
    /// Per layer, what the forward runs ([`crate::arch::Architecture::layer_plan`]).
    plans: Vec<crate::arch::LayerPlan>,
    /// The factor the embeddings are multiplied by ([`crate::arch::Architecture::embedding_scale`]).
    embedding_scale: Option<f32>,
    device: Device,
    /// The LM head's weights as a row table (quantized GGUF tensor), for draft heads that
    /// borrow rows of it ([`Model::lm_head_rows`]).
    lm_head_table: Option<Embedding>,
    /// The KV blocks every cache of this model draws from ([`Model::new_kv_cache`]).
    kv_pool: std::sync::Arc<crate::kv_cache::KvPool>,
    /// The norm weights of every block, and the output norm's, as f32 values.
    norms: Vec<BlockNorms>,
    output_norm_values: Vec<f32>,
    /// When set ([`Model::restrict_logits`]): the LM head rows of a token subset and their ids;
    /// logits are computed for those tokens only, every other token's is -inf.
    logit_subset: Option<(Linear, Vec<u32>)>,
}

/// One block's RMSNorm weights as f32 values (`[hidden]`; q/k: `[head_dim]`).
#[derive(Debug)]
struct BlockNorms {
    attn: Vec<f32>,
    ffn: Option<Vec<f32>>,
    q: Option<Vec<f32>>,
    k: Option<Vec<f32>>,
    post_attn: Option<Vec<f32>>,
    post_ffn: Option<Vec<f32>>,
}

/// RoPE's `cos` and `sin` per position and frequency, `[context, head_dim / 2]` f32.
#[derive(Debug)]
struct RopeTable {
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// theta_i = pos * base^(-2i/d) (RoFormer, Su et al. 2021), optionally divided by a
    /// per-frequency factor, computed as ggml's `rope_cache_init` does: in f32, theta_i by the
    /// recurrence theta_{i+1} = theta_i * base^(-2/d) from theta_0 = pos, then cosf / sinf;
    /// `freq_scale` multiplies each angle (linear scaling, ggml's `rope_yarn` without
    /// extrapolation).
    fn new(base: f64, head_dim: usize, context: usize, freq_factors: Option<&[f32]>, freq_scale: f32) -> Self {
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(context * half);
        let mut sin = Vec::with_capacity(context * half);
        let theta_scale = (base as f32).powf(-2.0f32 / head_dim as f32);
        for pos in 0..context {
            let mut theta = pos as f32;
            for i in 0..half {
                let t = freq_scale
                    * match freq_factors {
                        Some(ff) => theta / ff.get(i).copied().unwrap_or(1.0),
                        None => theta,
                    };
                cos.push(t.cos());
                sin.push(t.sin());
                theta *= theta_scale;
            }
        }
        Self { cos, sin }
    }
}

impl Model {
    /// Assemble a model from its weights; computes the RoPE tables. `rope_freq_factors` are
    /// llama.cpp's `rope_freqs.weight` (Llama 3.1 scaling), dividing each frequency.
    pub fn new(
        config: ModelConfig,
        embedding: Embedding,
        blocks: Vec<Block>,
        output_norm: Tensor,
        lm_head: Linear,
        rope_freq_factors: Option<Vec<f32>>,
        device: Device,
    ) -> Result<Self> {
        if blocks.len() != config.num_layers {
            bail!("expected {} blocks, got {}", config.num_layers, blocks.len());
        }
        let Some(arch) = crate::arch::try_of(&config) else {
            bail!("no registered architecture reads family '{}'", config.family.as_str());
        };
        if config.num_heads == 0 || config.num_kv_heads == 0 || !config.num_heads.is_multiple_of(config.num_kv_heads) {
            bail!(
                "num_heads ({}) must be a positive multiple of num_kv_heads ({})",
                config.num_heads,
                config.num_kv_heads
            );
        }
        if !config.head_dim.is_multiple_of(2) {
            bail!("head_dim must be even, got {}", config.head_dim);
        }
        let ctx = config.context_length;
        let config_stride = config.num_kv_heads * config.head_dim;
        let factors = rope_freq_factors.as_deref();
        let freq_scale = config.rope_freq_scale.unwrap_or(1.0) as f32;
        let rope = RopeTable::new(config.rope_theta, config.head_dim, ctx, factors, freq_scale);
        // The windowed layers' own table (their own base, no linear scaling).
        let rope_local = match &config.sliding_window {
            Some(w) if w.rope_theta != config.rope_theta || freq_scale != 1.0 => {
                Some(RopeTable::new(w.rope_theta, config.head_dim, ctx, factors, 1.0))
            }
            _ => None,
        };
        let plans = arch.layer_plan(&config);
        if plans.len() != config.num_layers {
            bail!(
                "the layer plan has {} layers, the config {}",
                plans.len(),
                config.num_layers
            );
        }
        let embedding_scale = arch.embedding_scale(&config);
        let norms = blocks
            .iter()
            .map(|b| {
                Ok(BlockNorms {
                    attn: f32_values(&b.attn_norm)?,
                    ffn: b.ffn_norm.as_ref().map(f32_values).transpose()?,
                    q: b.q_norm.as_ref().map(f32_values).transpose()?,
                    k: b.k_norm.as_ref().map(f32_values).transpose()?,
                    post_attn: b.post_attn_norm.as_ref().map(f32_values).transpose()?,
                    post_ffn: b.post_ffn_norm.as_ref().map(f32_values).transpose()?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        for (i, n) in norms.iter().enumerate() {
            let qk_ok = [&n.q, &n.k]
                .iter()
                .all(|w| w.as_ref().is_none_or(|w| w.len() == config.head_dim));
            let ffn_ok = [&n.ffn, &n.post_attn, &n.post_ffn]
                .iter()
                .all(|w| w.as_ref().is_none_or(|w| w.len() == config.hidden_size));
            if n.attn.len() != config.hidden_size || !ffn_ok || !qk_ok {
                bail!(
                    "block {i}: a norm weight does not match hidden_size {} / head_dim {}",
                    config.hidden_size,
                    config.head_dim
                );
            }
        }
        let output_norm_values = f32_values(&output_norm)?;
        if output_norm_values.len() != config.hidden_size {
            bail!(
                "the output norm has {} values, hidden_size is {}",
                output_norm_values.len(),
                config.hidden_size
            );
        }
        Ok(Self {
            arch,
            norms,
            output_norm_values,
            config,
            embedding,
            blocks,
            output_norm,
            lm_head,
            rope,
            rope_local,
            plans,
            embedding_scale,
            device,
            lm_head_table: None,
            logit_subset: None,
            kv_pool: crate::kv_cache::KvPool::new(config_stride),
        })
    }

    /// Compute logits for the tokens `ids` only (every other token's logit is -inf): a drafter's
    /// reduced vocabulary (FR-Spec: Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary
    /// Language Models via Frequency-Ranked Speculative Sampling"), which makes its LM head
    /// cheaper by the share of rows left out. The logits kept are bitwise the full head's. Only
    /// for a model that drafts: its proposals are verified by the target over the full
    /// vocabulary, so what is left out costs acceptance, never exactness. Errors: an id outside
    /// the vocabulary, or an LM head on candle's path.
    pub fn restrict_logits(&mut self, ids: &[u32]) -> Result<()> {
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= self.config.vocab_size) {
            bail!(
                "token id {bad} is outside the vocabulary ({} tokens)",
                self.config.vocab_size
            );
        }
        let Some(head) = self.lm_head.select_rows(ids) else {
            bail!("this model's LM head does not run on Specula's kernels: its vocabulary cannot be reduced");
        };
        self.logit_subset = Some((head, ids.to_vec()));
        Ok(())
    }

    /// Rows of the LM head a forward computes: the vocabulary, or the token subset of
    /// [`Model::restrict_logits`].
    pub fn logit_rows(&self) -> usize {
        self.logit_subset
            .as_ref()
            .map_or(self.config.vocab_size, |(_, ids)| ids.len())
    }

    /// Keep the LM head's weight table (the GGUF tensor behind [`Model::lm_head`]) so that
    /// [`Model::lm_head_rows`] can read rows of it.
    pub fn set_lm_head_table(&mut self, table: Embedding) {
        self.lm_head_table = Some(table);
    }

    /// Rows `ids` of the LM head's weight, dequantized: `[ids.len(), hidden]` f32 (what draft
    /// heads borrow). Errors: an id outside the vocabulary, or a model loaded without the table.
    pub fn lm_head_rows(&self, ids: &[u32]) -> Result<Tensor> {
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= self.config.vocab_size) {
            bail!(
                "token id {bad} is outside the vocabulary ({} tokens)",
                self.config.vocab_size
            );
        }
        if let Some(t) = &self.lm_head_table {
            return t.forward(ids, &self.device);
        }
        match &self.lm_head.weight {
            Weight::Candle(QMatMul::Tensor(w)) => {
                let idx = Tensor::new(ids, &self.device)?;
                Ok(w.index_select(&idx, 0)?.to_dtype(DType::F32)?)
            }
            _ => bail!("this model's LM head rows are not available to draft heads"),
        }
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Are the logits of row i of a multi-row forward bitwise equal to a one-row forward at the
    /// same position? Needs every projection on a batch-invariant kernel (attention, norms and
    /// element-wise ops always are). Greedy speculation is exact only on such a model.
    pub fn batch_invariant(&self) -> bool {
        self.lm_head.is_batch_invariant()
            && self
                .blocks
                .iter()
                .all(|b| [&b.q, &b.k, &b.v, &b.o].iter().all(|l| l.is_batch_invariant()) && b.mlp.is_batch_invariant())
    }

    /// A KV cache sized for this model's context window, with blocks from the model's pool.
    pub fn new_kv_cache(&self) -> KvCache {
        KvCache::with_pool(
            self.config.num_layers,
            self.config.num_kv_heads,
            self.config.head_dim,
            self.config.context_length,
            self.kv_pool.clone(),
        )
    }

    /// The counters of the KV block pool shared by this model's caches.
    pub fn kv_pool_stats(&self) -> crate::kv_cache::KvPoolStats {
        self.kv_pool.stats()
    }

    /// The KV block pool shared by this model's caches.
    pub fn kv_pool(&self) -> &std::sync::Arc<crate::kv_cache::KvPool> {
        &self.kv_pool
    }

    /// Run `tokens` at positions `kv.len() .. kv.len() + tokens.len()`, append their keys and
    /// values to `kv`, and return logits for the rows named by `rows` and the hidden states after
    /// the blocks listed in `taps`.
    ///
    /// Errors: empty `tokens`, a position past the context window, a token id outside the vocab.
    pub fn forward(&self, tokens: &[u32], kv: &mut KvCache, rows: LogitsRows, taps: &[usize]) -> Result<ForwardOutput> {
        let mut segs = [Segment { tokens, kv, rows }];
        let mut outs = self.forward_batch(&mut segs, taps)?;
        outs.pop()
            .ok_or_else(|| anyhow::anyhow!("the forward returned no output"))
    }

    /// One forward pass over several sequences at once (continuous batching): the rows of every
    /// segment are stacked through the projections and the MLP (the weights are read once for
    /// all of them), and each segment attends over its own KV cache at its own positions.
    /// Returns one [`ForwardOutput`] per segment, in order, as [`Model::forward`] would for that
    /// segment alone; on batch-invariant kernels ([`Model::batch_invariant`]) the bits are the
    /// same, whatever the other segments are.
    ///
    /// Errors: as [`Model::forward`], for any segment; no segment's cache then changes.
    pub fn forward_batch(&self, segs: &mut [Segment<'_>], taps: &[usize]) -> Result<Vec<ForwardOutput>> {
        // The parallel kernels inside share the work with the spinning helpers of
        // `kernels::pool`, on the calling thread.
        let out = self.forward_inner(segs, taps);
        if out.is_err() {
            for s in segs.iter_mut() {
                s.kv.discard_uncommitted();
            }
        }
        out
    }

    fn forward_inner(&self, segs: &mut [Segment<'_>], taps: &[usize]) -> Result<Vec<ForwardOutput>> {
        let cfg = &self.config;
        if segs.is_empty() {
            bail!("forward needs at least one sequence");
        }
        for s in segs.iter() {
            let (n, start) = (s.tokens.len(), s.kv.len());
            if n == 0 {
                bail!("forward needs at least one token");
            }
            if start + n > cfg.context_length {
                bail!(
                    "positions {}..{} exceed the context window of {} tokens",
                    start,
                    start + n,
                    cfg.context_length
                );
            }
            if let Some(&bad) = s.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                bail!("token id {bad} is outside the vocabulary ({} tokens)", cfg.vocab_size);
            }
        }
        if let Some(&bad) = taps.iter().find(|&&t| t > cfg.num_layers) {
            bail!("hidden-state tap {bad} is out of range (0..={})", cfg.num_layers);
        }
        let eps = cfg.rms_norm_eps as f32;
        let hs = cfg.hidden_size;
        let tokens: Vec<u32> = segs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let total = tokens.len();
        // The residual stream, `[total, hidden]`: plain buffers through the blocks (a decode
        // step is ~200 small products; tensor round trips between them cost allocations and
        // copies on the one thread the kernel pool's helpers wait for).
        let mut x = f32_values(&self.embedding.forward(&tokens, &self.device)?)?;
        if x.len() != total * hs {
            bail!("the embedding returned {} values for {total} tokens of {hs}", x.len());
        }
        if let Some(s) = self.embedding_scale {
            // ggml_scale: one f32 product per value.
            for v in x.iter_mut() {
                *v *= s;
            }
        }
        let mut hidden: Vec<Option<Vec<f32>>> = vec![None; taps.len()];
        for li in 0..self.blocks.len() {
            let mut layer = LayerPass {
                model: self,
                li,
                segs: &mut *segs,
                rows: total,
            };
            self.arch.layer_forward(&mut layer, &mut x)?;
            for (slot, &t) in hidden.iter_mut().zip(taps) {
                if t == li {
                    *slot = Some(x.clone());
                }
            }
        }
        for s in segs.iter_mut() {
            s.kv.advance(s.tokens.len())?;
        }
        let normed = rms_norm(&x, &self.output_norm_values, eps);
        for (slot, &t) in hidden.iter_mut().zip(taps) {
            if t == cfg.num_layers {
                *slot = Some(normed.clone());
            }
        }
        let hidden: Vec<Tensor> = hidden
            .into_iter()
            .flatten()
            .map(|h| Tensor::from_vec(h, (total, hs), &self.device))
            .collect::<candle_core::Result<_>>()?;
        // The rows that need logits, through the LM head in one product.
        let mut rows = Vec::new();
        let mut off = 0;
        for s in segs.iter() {
            let n = s.tokens.len();
            let picked = match s.rows {
                LogitsRows::All => off..off + n,
                LogitsRows::Last => off + n - 1..off + n,
                LogitsRows::None => off..off,
            };
            rows.extend_from_slice(&normed[picked.start * hs..picked.end * hs]);
            off += n;
        }
        let logits = if rows.is_empty() {
            None
        } else {
            let m = rows.len() / hs;
            // llama.cpp runs its LM head on the output rows alone (see the last MLP above).
            let l = match &self.logit_subset {
                None => crate::kernels::kquants::with_llamacpp_batches(false, || self.lm_head.forward_rows(&rows, m))?,
                Some((head, ids)) => {
                    let part = crate::kernels::kquants::with_llamacpp_batches(false, || head.forward_rows(&rows, m))?;
                    let mut l = vec![f32::NEG_INFINITY; m * cfg.vocab_size];
                    for (dst, src) in l.chunks_exact_mut(cfg.vocab_size).zip(part.chunks_exact(ids.len())) {
                        for (&id, &v) in ids.iter().zip(src) {
                            dst[id as usize] = v;
                        }
                    }
                    l
                }
            };
            Some(Tensor::from_vec(l, (m, cfg.vocab_size), &self.device)?)
        };
        let mut outs = Vec::with_capacity(segs.len());
        let (mut off, mut lrow) = (0, 0);
        for s in segs.iter() {
            let n = s.tokens.len();
            let k = match s.rows {
                LogitsRows::All => n,
                LogitsRows::Last => 1,
                LogitsRows::None => 0,
            };
            let seg_logits = match &logits {
                Some(l) if k > 0 => l.narrow(0, lrow, k)?,
                _ => Tensor::zeros((0, cfg.vocab_size), DType::F32, &self.device)?,
            };
            let seg_hidden = hidden
                .iter()
                .map(|h| h.narrow(0, off, n))
                .collect::<candle_core::Result<Vec<_>>>()?;
            outs.push(ForwardOutput {
                logits: seg_logits,
                hidden: seg_hidden,
            });
            off += n;
            lrow += k;
        }
        Ok(outs)
    }

    /// Grouped-query attention of block `li` for `h` (`[rows of all segments, hidden]`): each
    /// segment's rows at its positions `kv.len() .. kv.len() + n` over its own cache; appends K
    /// and V to each cache. Returns `[rows, hidden]` (after the output projection).
    fn attention(
        &self,
        block: &Block,
        norms: &BlockNorms,
        li: usize,
        h: &[f32],
        segs: &mut [Segment<'_>],
    ) -> Result<Vec<f32>> {
        let cfg = &self.config;
        let total = h.len() / cfg.hidden_size;
        let d = cfg.head_dim;
        let eps = cfg.rms_norm_eps as f32;
        let [mut q, mut k, v]: [Vec<f32>; 3] = Linear::forward_rows_many(&[&block.q, &block.k, &block.v], h, total)?
            .try_into()
            .map_err(|_| anyhow::anyhow!("q, k and v: expected three products"))?;
        if let (Some(qn), Some(kn)) = (&norms.q, &norms.k) {
            q = rms_norm(&q, qn, eps);
            k = rms_norm(&k, kn, eps);
        }
        let (qw, kw) = (cfg.num_heads * d, cfg.num_kv_heads * d);
        let window = match self.plans[li].attention {
            crate::arch::AttentionKind::Full => None,
            crate::arch::AttentionKind::Sliding { window } => Some(window),
        };
        let rope = match (window, &self.rope_local) {
            (Some(_), Some(local)) => local,
            _ => &self.rope,
        };
        // Per segment: RoPE at its positions, and K and V into its cache (which stores them
        // rounded to f16, llama.cpp's default cache type).
        let mut spans = Vec::with_capacity(segs.len());
        let mut off = 0;
        for s in segs.iter_mut() {
            let n = s.tokens.len();
            let start = s.kv.len();
            let qs = &mut q[off * qw..(off + n) * qw];
            self.apply_rope(rope, qs, cfg.num_heads, start);
            if let Some(f) = cfg.query_scale {
                // ggml_scale of the roped queries (llama.cpp's Gemma graph).
                let f = f as f32;
                for v in qs.iter_mut() {
                    *v *= f;
                }
            }
            let ks = &mut k[off * kw..(off + n) * kw];
            self.apply_rope(rope, ks, cfg.num_kv_heads, start);
            s.kv.append(li, ks, &v[off * kw..(off + n) * kw])?;
            spans.push((off, start, n));
            off += n;
        }
        // Every segment's attention in one parallel pass.
        let rows: Vec<_> = segs
            .iter()
            .zip(&spans)
            .map(|(s, &(_, start, n))| s.kv.rows(li, start + n))
            .collect();
        let items: Vec<attention::AttnItem<'_>> = spans
            .iter()
            .zip(&rows)
            .map(|(&(off, start, n), kv)| attention::AttnItem {
                q: &q[off * qw..(off + n) * qw],
                kv,
                shape: attention::AttnShape {
                    rows: n,
                    start,
                    num_heads: cfg.num_heads,
                    num_kv_heads: cfg.num_kv_heads,
                    head_dim: d,
                    window,
                    scale: if cfg.query_scale.is_some() {
                        1.0
                    } else {
                        1.0 / (d as f32).sqrt()
                    },
                },
            })
            .collect();
        let out = attention::attend_batch(&items);
        block.o.forward_rows(&out, total)
    }

    /// Rotate `x` (`[n, heads, head_dim]`, row r at position `start + r`) in place, as ggml's
    /// `rotate_pairs` (GCC contracts it into FMAs): `x0' = fma(x0, cos, -(x1 sin))`,
    /// `x1' = fma(x0, sin, x1 cos)`.
    fn apply_rope(&self, rope: &RopeTable, x: &mut [f32], heads: usize, start: usize) {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("fma") {
            // SAFETY: FMA was detected at run time.
            return unsafe { self.apply_rope_fma(rope, x, heads, start) };
        }
        self.apply_rope_body(rope, x, heads, start)
    }

    /// [`Model::apply_rope`] compiled with FMA (one instruction per `mul_add`, same bits).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "fma")]
    unsafe fn apply_rope_fma(&self, rope: &RopeTable, x: &mut [f32], heads: usize, start: usize) {
        self.apply_rope_body(rope, x, heads, start)
    }

    #[inline(always)]
    fn apply_rope_body(&self, rope: &RopeTable, x: &mut [f32], heads: usize, start: usize) {
        let d = self.config.head_dim;
        let half = d / 2;
        for (r, row) in x.chunks_exact_mut(heads * d).enumerate() {
            let pos = start + r;
            let cos = &rope.cos[pos * half..(pos + 1) * half];
            let sin = &rope.sin[pos * half..(pos + 1) * half];
            for head in row.chunks_exact_mut(d) {
                match self.config.rope_style {
                    RopeStyle::Interleaved => {
                        for i in 0..half {
                            let (a, b) = (head[2 * i], head[2 * i + 1]);
                            head[2 * i] = a.mul_add(cos[i], -(b * sin[i]));
                            head[2 * i + 1] = a.mul_add(sin[i], b * cos[i]);
                        }
                    }
                    RopeStyle::Neox => {
                        for i in 0..half {
                            let (a, b) = (head[i], head[i + half]);
                            head[i] = a.mul_add(cos[i], -(b * sin[i]));
                            head[i + half] = a.mul_add(sin[i], b * cos[i]);
                        }
                    }
                }
            }
        }
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }
}

/// One layer of a forward pass, as an architecture's
/// [`crate::arch::Architecture::layer_forward`] sees it: the layer's weights and the operations
/// a block is built from. Each operation maps rows to rows independently (batch-invariant on
/// Specula's kernels), over the stacked rows of every segment of the pass.
pub struct LayerPass<'m, 's, 'a> {
    model: &'m Model,
    li: usize,
    segs: &'s mut [Segment<'a>],
    /// Rows in the pass (all segments).
    rows: usize,
}

impl LayerPass<'_, '_, '_> {
    /// The layer's index (0-based).
    pub fn index(&self) -> usize {
        self.li
    }

    /// Whether this is the model's last layer.
    pub fn is_last(&self) -> bool {
        self.li + 1 == self.model.blocks.len()
    }

    /// RMSNorm of `x` (`[rows, hidden]`) with the attention norm's weights.
    pub fn attn_norm(&self, x: &[f32]) -> Vec<f32> {
        rms_norm(
            x,
            &self.model.norms[self.li].attn,
            self.model.config.rms_norm_eps as f32,
        )
    }

    /// RMSNorm of `x` with the MLP norm's weights. Errors: the layer has no MLP norm.
    pub fn ffn_norm(&self, x: &[f32]) -> Result<Vec<f32>> {
        let Some(w) = &self.model.norms[self.li].ffn else {
            bail!("layer {} has no MLP norm", self.li);
        };
        Ok(rms_norm(x, w, self.model.config.rms_norm_eps as f32))
    }

    /// Grouped-query attention of `h` (`[rows, hidden]`, normed) over each segment's cache at
    /// its positions, appending the rows' keys and values; `[rows, hidden]` after the output
    /// projection.
    pub fn attention(&mut self, h: &[f32]) -> Result<Vec<f32>> {
        let m = self.model;
        m.attention(&m.blocks[self.li], &m.norms[self.li], self.li, h, self.segs)
    }

    /// RMSNorm of the attention's output `a` (`[rows, hidden]`) with the post-attention norm's
    /// weights (Gemma). Errors: the layer has none.
    pub fn post_attn_norm(&self, a: &[f32]) -> Result<Vec<f32>> {
        let Some(w) = &self.model.norms[self.li].post_attn else {
            bail!("layer {} has no post-attention norm", self.li);
        };
        Ok(rms_norm(a, w, self.model.config.rms_norm_eps as f32))
    }

    /// RMSNorm of the MLP's output with the post-MLP norm's weights (Gemma). Errors: the layer
    /// has none.
    pub fn post_ffn_norm(&self, m: &[f32]) -> Result<Vec<f32>> {
        let Some(w) = &self.model.norms[self.li].post_ffn else {
            bail!("layer {} has no post-MLP norm", self.li);
        };
        Ok(rms_norm(m, w, self.model.config.rms_norm_eps as f32))
    }

    /// The gated MLP of `h` (`[rows, hidden]`): `down(act(gate(h)) * up(h))`, the activation
    /// by the layer plan's [`crate::arch::MlpKind`] (SiLU, or GELU with the tanh approximation).
    pub fn mlp(&self, h: &[f32]) -> Result<Vec<f32>> {
        let block = &self.model.blocks[self.li];
        let total = self.rows;
        let kind = self.model.plans[self.li].mlp;
        let mlp = || -> Result<Vec<f32>> {
            use crate::arch::MlpKind;
            let dense = match (&block.mlp, kind) {
                (Mlp::Moe(m), MlpKind::Moe | MlpKind::MoeShared) => return m.forward(h, total),
                (Mlp::Dense(d), MlpKind::DenseSwiGlu | MlpKind::DenseGeGlu) => d,
                _ => bail!(
                    "layer {}: its weights do not match the layer plan's {kind:?} MLP",
                    self.li
                ),
            };
            let [g, u]: [Vec<f32>; 2] = Linear::forward_rows_many(&[&dense.gate, &dense.up], h, total)?
                .try_into()
                .map_err(|_| anyhow::anyhow!("gate and up: expected two products"))?;
            let act = match kind {
                MlpKind::DenseGeGlu => attention::gelu_mul(&g, &u),
                _ => attention::silu_mul(&g, &u),
            };
            dense.down.forward_rows(&act, total)
        };
        if self.is_last() {
            // llama.cpp runs the last block's MLP on the output rows alone (one row for a
            // prompt), which matters only to its batch arithmetic (see
            // `with_llamacpp_batches`); serving's arithmetic is per row.
            crate::kernels::kquants::with_llamacpp_batches(false, mlp)
        } else {
            mlp()
        }
    }

    /// The sandwich-norm block (Gemma 2/3): `x += post_attn_norm(attn(attn_norm(x)));
    /// x += post_ffn_norm(mlp(ffn_norm(x)))`.
    pub fn sandwich_norm_block(&mut self, x: &mut [f32]) -> Result<()> {
        let h = self.attn_norm(x);
        let a = self.attention(&h)?;
        add_assign(x, &self.post_attn_norm(&a)?);
        let h = self.ffn_norm(x)?;
        let m = self.mlp(&h)?;
        add_assign(x, &self.post_ffn_norm(&m)?);
        Ok(())
    }

    /// The pre-norm block (Llama): `x += attn(attn_norm(x)); x += mlp(ffn_norm(x))`.
    pub fn pre_norm_block(&mut self, x: &mut [f32]) -> Result<()> {
        let h = self.attn_norm(x);
        let a = self.attention(&h)?;
        add_assign(x, &a);
        let h = self.ffn_norm(x)?;
        let m = self.mlp(&h)?;
        add_assign(x, &m);
        Ok(())
    }
}

#[cfg(test)]
mod rms_norm_tests {
    use super::*;

    #[test]
    fn grouped_rms_norm_is_bitwise_the_one_row_loop() {
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            // Values over many magnitudes, so the f64 sums' rounding order matters.
            let m = ((state >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32;
            m * [1e-3f32, 1.0, 37.0, 1e4][(state & 3) as usize]
        };
        for h in [1usize, 7, 64, 576] {
            let w: Vec<f32> = (0..h).map(|_| next()).collect();
            for n in 0..=(2 * RMS_GROUP + 3) {
                let x: Vec<f32> = (0..n * h).map(|_| next()).collect();
                let got = rms_norm(&x, &w, 1e-5);
                let want: Vec<f32> = x.chunks_exact(h).flat_map(|r| rms_norm_row(r, &w, 1e-5)).collect();
                let (g, e): (Vec<u32>, Vec<u32>) = (
                    got.iter().map(|v| v.to_bits()).collect(),
                    want.iter().map(|v| v.to_bits()).collect(),
                );
                assert_eq!(g, e, "h {h} rows {n}");
            }
        }
    }
}
