//! The layers of native draft heads (MTP heads, block drafters), written once with candle tensor
//! operations so that the same code drafts (plain tensors) and trains (`specula distill`: the
//! weights are candle `Var`s and the loss is back-propagated through this code).
//!
//! A head block is a pre-norm transformer block of the target's family (Touvron et al. 2023, as
//! in [`crate::model`]): RMSNorm → grouped-query attention with RoPE (Qwen2 q/k/v biases, Qwen3
//! per-head q/k norms) → residual → RMSNorm → SwiGLU → residual. Unlike the target's forward,
//! nothing here is bit-for-bit llama.cpp: a drafter's numbers only decide what is proposed, and
//! the target verifies every proposal.

use std::collections::HashMap;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor, D};
use serde::{Deserialize, Serialize};

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};

use crate::arch::{llama, BundleFormat, Role};
use crate::model::{Linear, Model, RopeStyle};

/// Shape of a head block: the target's attention and MLP hyper-parameters by default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlockShape {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// `interleaved` (GGUF Llama q/k) or `neox` (HF checkpoints, Qwen).
    pub rope_style: String,
}

impl BlockShape {
    /// The target's block shape.
    pub fn of_target(model: &Model) -> Self {
        let c = model.config();
        Self {
            hidden_size: c.hidden_size,
            intermediate_size: c.intermediate_size,
            num_attention_heads: c.num_heads,
            num_key_value_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            rms_norm_eps: c.rms_norm_eps,
            rope_theta: c.rope_theta,
            rope_style: match c.rope_style {
                RopeStyle::Interleaved => "interleaved".into(),
                RopeStyle::Neox => "neox".into(),
            },
        }
    }

    fn interleaved(&self) -> bool {
        self.rope_style == "interleaved"
    }
}

/// A dense linear layer `y = x W^T (+ b)`, `W`: `[out, in]` f32.
#[derive(Debug, Clone)]
pub struct Dense {
    pub w: Tensor,
    pub b: Option<Tensor>,
    /// For drafting: the weight quantized ([`PROJECTION_DTYPE`]) on our own kernels (a sixth
    /// of the f32 bytes to read per token). `None` while training (gradients flow through `w`).
    pub fast: Option<Arc<Linear>>,
}

/// `w` (`[out, in]` f32) quantized to [`PROJECTION_DTYPE`] for our kernels, when `in` is a
/// multiple of 32.
fn quantize(w: &Tensor, b: Option<&Tensor>) -> Result<Option<Arc<Linear>>> {
    quantize_as(w, b, PROJECTION_DTYPE)
}

/// The format a head's projections (block, `[embedding ; hidden]`, `hidden_fc`) draft in. Q5_0
/// reads 0.65 of Q8_0's bytes; on the committed SmolLM2 head it cut a draft token from about
/// 620 to 555 µs with depth-1 acceptance on the shared prompts unchanged (0.588 against 0.586;
/// Q4_0: 0.578). The draft LM head stays Q8_0, the target's own rows: in Q5_0 prose acceptance
/// fell from 0.576 to 0.560 (docs/perf.md).
const PROJECTION_DTYPE: GgmlDType = GgmlDType::Q5_0;

fn quantize_as(w: &Tensor, b: Option<&Tensor>, dtype: GgmlDType) -> Result<Option<Arc<Linear>>> {
    let (_, inp) = w.dims2()?;
    if !inp.is_multiple_of(32) {
        return Ok(None);
    }
    let q = QTensor::quantize(&w.contiguous()?, dtype)?;
    Ok(Some(Arc::new(Linear::from_qtensor(Arc::new(q), b.cloned())?)))
}

impl Dense {
    pub fn new(w: Tensor, b: Option<Tensor>) -> Self {
        Self { w, b, fast: None }
    }

    /// Use a quantized copy of the weight from now on (drafting, not training).
    pub fn quantize_for_drafting(&mut self) -> Result<()> {
        self.fast = quantize(&self.w, self.b.as_ref())?;
        Ok(())
    }

    /// `x`: `[n, in]` or `[b, n, in]` → `[.., out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if let Some(f) = &self.fast {
            let mut dims = x.dims().to_vec();
            let inp = dims.pop().unwrap_or(1);
            let rows: usize = dims.iter().product();
            let y = f.forward(&x.reshape((rows, inp))?)?;
            dims.push(y.dim(1)?);
            return Ok(y.reshape(dims)?);
        }
        let y = match x.rank() {
            2 => x.matmul(&self.w.t()?)?,
            _ => x.broadcast_matmul(&self.w.t()?)?,
        };
        Ok(match &self.b {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }
}

/// RMSNorm over the last dimension, `x / sqrt(mean(x²) + eps) * w` (differentiable).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    Ok(x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w)?)
}

/// How the new rows of a block attend.
#[derive(Debug, Clone)]
pub enum AttnMask {
    /// Row `i` sees every past key and the new rows `0..=i` (MTP heads).
    Causal,
    /// Every new row sees every past key and every new row (a block drafter's block).
    Bidirectional,
    /// An additive bias `[n, m + n]` (0 = visible, a large negative value = hidden): several
    /// drafter blocks trained in one pass.
    Bias(Tensor),
}

/// One transformer block of a head.
#[derive(Debug, Clone)]
pub struct HeadBlock {
    pub shape: BlockShape,
    pub attn_norm: Tensor,
    pub q: Dense,
    pub k: Dense,
    pub v: Dense,
    pub o: Dense,
    pub q_norm: Option<Tensor>,
    pub k_norm: Option<Tensor>,
    pub ffn_norm: Tensor,
    pub gate: Dense,
    pub up: Dense,
    pub down: Dense,
}

/// The share of `seconds` (the time a native drafter spent feeding `rows` committed rows into
/// its own cache) that was catch-up ([`super::Drafter::last_catch_up_s`]): the rows past what a
/// step without a pause before it feeds, which is the tokens the last verify committed, at most
/// its `last_draft` tokens plus the target's own.
pub fn catch_up_share(seconds: f64, rows: usize, last_draft: usize) -> f64 {
    let steady = last_draft + 1;
    if rows > steady {
        seconds * (rows - steady) as f64 / rows as f64
    } else {
        0.0
    }
}

/// Positions `pos0 .. pos0 + n`.
pub fn span(pos0: usize, n: usize) -> Vec<usize> {
    (pos0..pos0 + n).collect()
}

/// RoPE cos / sin tables `[n, head_dim / 2]` for `positions` (RoFormer, Su et al. 2021:
/// theta_i = pos · base^(-2i/d)).
pub fn rope_tables(shape: &BlockShape, positions: &[usize], device: &Device) -> Result<(Tensor, Tensor)> {
    let half = shape.head_dim / 2;
    let n = positions.len();
    let mut cos = Vec::with_capacity(n * half);
    let mut sin = Vec::with_capacity(n * half);
    for &p in positions {
        for i in 0..half {
            let inv = shape.rope_theta.powf(-2.0 * i as f64 / shape.head_dim as f64);
            let t = p as f64 * inv;
            cos.push(t.cos() as f32);
            sin.push(t.sin() as f32);
        }
    }
    Ok((
        Tensor::from_vec(cos, (n, half), device)?,
        Tensor::from_vec(sin, (n, half), device)?,
    ))
}

impl HeadBlock {
    /// Quantize every projection for drafting ([`Dense::quantize_for_drafting`]).
    pub fn quantize_for_drafting(&mut self) -> Result<()> {
        for d in [
            &mut self.q,
            &mut self.k,
            &mut self.v,
            &mut self.o,
            &mut self.gate,
            &mut self.up,
            &mut self.down,
        ] {
            d.quantize_for_drafting()?;
        }
        Ok(())
    }

    /// Rotate `x` (`[b, heads, n, head_dim]`) by the tables of [`rope_tables`].
    pub fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let x = x.contiguous()?;
        Ok(if self.shape.interleaved() {
            candle_nn::rotary_emb::rope_i_slow(&x, cos, sin)?
        } else {
            candle_nn::rotary_emb::rope_slow(&x, cos, sin)?
        })
    }

    /// Keys and values of `x` (`[b, n, hidden]`, already normed as the block's attention input
    /// expects, or a context feature) at `positions`: each `[b, kv_heads, n, head_dim]`, keys
    /// rotated.
    pub fn keys_values(&self, x: &Tensor, positions: &[usize]) -> Result<(Tensor, Tensor)> {
        let s = &self.shape;
        let (b, n, _) = x.dims3()?;
        let (hk, d) = (s.num_key_value_heads, s.head_dim);
        let mut k = self.k.forward(x)?.reshape((b, n, hk, d))?;
        if let Some(kn) = &self.k_norm {
            k = rms_norm(&k, kn, s.rms_norm_eps)?;
        }
        let k = k.transpose(1, 2)?;
        let v = self
            .v
            .forward(x)?
            .reshape((b, n, hk, d))?
            .transpose(1, 2)?
            .contiguous()?;
        let (cos, sin) = rope_tables(s, positions, x.device())?;
        Ok((self.rope(&k, &cos, &sin)?, v))
    }

    /// Run the block on `x` (`[b, n, hidden]`, rows at `positions`), attending to `past` keys
    /// and values (each `[b, kv_heads, m, head_dim]`, rotated) and to the new rows as `mask`
    /// says. Returns the block's output `[b, n, hidden]` and the new rows' keys and values
    /// (`[b, kv_heads, n, head_dim]`) for the caller's cache.
    pub fn forward(
        &self,
        x: &Tensor,
        positions: &[usize],
        past: Option<(&Tensor, &Tensor)>,
        mask: &AttnMask,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let s = &self.shape;
        let (b, n, _) = x.dims3()?;
        let (hq, hk, d) = (s.num_attention_heads, s.num_key_value_heads, s.head_dim);
        let h = rms_norm(x, &self.attn_norm, s.rms_norm_eps)?;
        let mut q = self.q.forward(&h)?.reshape((b, n, hq, d))?;
        if let Some(qn) = &self.q_norm {
            q = rms_norm(&q, qn, s.rms_norm_eps)?;
        }
        let (cos, sin) = rope_tables(s, positions, x.device())?;
        let q = self.rope(&q.transpose(1, 2)?, &cos, &sin)?;
        let (k_new, v_new) = self.keys_values(&h, positions)?;
        let (k, v) = match past {
            Some((pk, pv)) => (Tensor::cat(&[pk, &k_new], 2)?, Tensor::cat(&[pv, &v_new], 2)?),
            None => (k_new.clone(), v_new.clone()),
        };
        let m = k.dim(2)? - n;
        let rep = hq / hk;
        let expand = |t: &Tensor| -> Result<Tensor> {
            let (b, hk, len, d) = t.dims4()?;
            Ok(t.unsqueeze(2)?
                .broadcast_as((b, hk, rep, len, d))?
                .contiguous()?
                .reshape((b, hk * rep, len, d))?)
        };
        let (k, v) = (expand(&k)?, expand(&v)?);
        let scores = (q.matmul(&k.t()?.contiguous()?)? / (d as f64).sqrt())?;
        let scores = match mask {
            AttnMask::Bidirectional => scores,
            AttnMask::Bias(b) => scores.broadcast_add(b)?,
            AttnMask::Causal => {
                let mut bias = vec![0f32; n * (m + n)];
                for i in 0..n {
                    for j in m + i + 1..m + n {
                        bias[i * (m + n) + j] = -1e9;
                    }
                }
                let bias = Tensor::from_vec(bias, (n, m + n), x.device())?;
                scores.broadcast_add(&bias)?
            }
        };
        let probs = candle_nn::ops::softmax(&scores, D::Minus1)?;
        let att = probs.matmul(&v)?.transpose(1, 2)?.reshape((b, n, hq * d))?;
        let x = (x + self.o.forward(&att)?)?;
        let h = rms_norm(&x, &self.ffn_norm, s.rms_norm_eps)?;
        let g = self.gate.forward(&h)?;
        let u = self.up.forward(&h)?;
        let x = (&x + self.down.forward(&(g.silu()? * u)?)?)?;
        Ok((x, k_new, v_new))
    }
}

/// Named f32 tensors of a head, with the file they came from for error messages.
pub struct NamedTensors {
    pub file: String,
    pub map: HashMap<String, Tensor>,
}

impl NamedTensors {
    /// Read every `.safetensors` file of `path` (a directory, or one file), converted to f32
    /// (integer tensors keep their type).
    pub fn read(path: &std::path::Path) -> Result<Self> {
        let files: Vec<std::path::PathBuf> = if path.is_dir() {
            let mut v: Vec<_> = std::fs::read_dir(path)
                .with_context(|| format!("reading {}", path.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            v.sort();
            v
        } else {
            vec![path.to_path_buf()]
        };
        if files.is_empty() {
            bail!("{}: no .safetensors file", path.display());
        }
        let mut map = HashMap::new();
        for f in &files {
            // A regular file only (a FIFO would block the open).
            crate::bundle::open_file(f).with_context(|| format!("{}", f.display()))?;
            let ts = candle_core::safetensors::load(f, &Device::Cpu)
                .with_context(|| format!("{}: not a readable safetensors file", f.display()))?;
            for (k, t) in ts {
                let t = match t.dtype() {
                    DType::F16 | DType::BF16 | DType::F64 => t.to_dtype(DType::F32)?,
                    _ => t,
                };
                map.insert(k, t);
            }
        }
        Ok(Self {
            file: if files.len() == 1 {
                files[0].display().to_string()
            } else {
                path.display().to_string()
            },
            map,
        })
    }

    /// The tensor `name`, of shape `dims` (errors name the file, the tensor and both shapes).
    pub fn get(&self, name: &str, dims: &[usize], what: &str) -> Result<Tensor> {
        let t = self
            .map
            .get(name)
            .ok_or_else(|| anyhow!("{}: missing tensor '{name}' ({what})", self.file))?;
        if t.dims() != dims {
            bail!(
                "{}: tensor '{name}' has shape {:?}, expected {dims:?} ({what})",
                self.file,
                t.dims()
            );
        }
        Ok(t.clone())
    }

    pub fn opt(&self, name: &str, dims: &[usize], what: &str) -> Result<Option<Tensor>> {
        if self.map.contains_key(name) {
            self.get(name, dims, what).map(Some)
        } else {
            Ok(None)
        }
    }

    /// A head block under `prefix`, in the HF names of the dense block
    /// ([`crate::arch::llama`]: the attention norm, q/k/v/o projections with optional biases,
    /// optional q/k norms, the MLP norm, gate/up/down projections).
    pub fn block(&self, prefix: &str, shape: &BlockShape) -> Result<HeadBlock> {
        let s = shape;
        let (h, f) = (s.hidden_size, s.intermediate_size);
        let (qd, kd) = (s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim);
        let name = |r: Role| format!("{prefix}{}", llama::base(r, BundleFormat::Hf));
        let lin = |w: Role, b: Option<Role>, out: usize, inp: usize| -> Result<Dense> {
            let bias = match b {
                Some(b) => self.opt(&name(b), &[out], "a projection bias")?,
                None => None,
            };
            Ok(Dense::new(self.get(&name(w), &[out, inp], "a projection")?, bias))
        };
        let norm = |r: Role| self.get(&name(r), &[h], "a norm over the hidden size");
        let head_norm = |r: Role| self.opt(&name(r), &[s.head_dim], "a per-head norm");
        Ok(HeadBlock {
            shape: s.clone(),
            attn_norm: norm(Role::AttnNorm)?,
            q: lin(Role::AttnQ, Some(Role::AttnQBias), qd, h)?,
            k: lin(Role::AttnK, Some(Role::AttnKBias), kd, h)?,
            v: lin(Role::AttnV, Some(Role::AttnVBias), kd, h)?,
            o: lin(Role::AttnOutput, None, h, qd)?,
            q_norm: head_norm(Role::AttnQNorm)?,
            k_norm: head_norm(Role::AttnKNorm)?,
            ffn_norm: norm(Role::FfnNorm)?,
            gate: lin(Role::FfnGate, None, f, h)?,
            up: lin(Role::FfnUp, None, f, h)?,
            down: lin(Role::FfnDown, None, h, f)?,
        })
    }
}

/// The tensors of a head block under `prefix`, by HF name (the inverse of
/// [`NamedTensors::block`]), for writing.
pub fn block_tensors(b: &HeadBlock, prefix: &str) -> Vec<(String, Tensor)> {
    let name = |r: Role| format!("{prefix}{}", llama::base(r, BundleFormat::Hf));
    let mut v = vec![
        (name(Role::AttnNorm), b.attn_norm.clone()),
        (name(Role::FfnNorm), b.ffn_norm.clone()),
    ];
    for (w, bias, l) in [
        (Role::AttnQ, Some(Role::AttnQBias), &b.q),
        (Role::AttnK, Some(Role::AttnKBias), &b.k),
        (Role::AttnV, Some(Role::AttnVBias), &b.v),
        (Role::AttnOutput, None, &b.o),
        (Role::FfnGate, None, &b.gate),
        (Role::FfnUp, None, &b.up),
        (Role::FfnDown, None, &b.down),
    ] {
        v.push((name(w), l.w.clone()));
        if let (Some(br), Some(t)) = (bias, &l.b) {
            v.push((name(br), t.clone()));
        }
    }
    if let Some(t) = &b.q_norm {
        v.push((name(Role::AttnQNorm), t.clone()));
    }
    if let Some(t) = &b.k_norm {
        v.push((name(Role::AttnKNorm), t.clone()));
    }
    v
}

/// A draft token, the sparse distribution it was drawn from when it was sampled, and the
/// drafter's probability of it ([`super::Proposal::confidence`]).
pub type ConfidentPick = (u32, Option<Vec<(u32, f32)>>, f32);

/// The draft LM head: rows of the target's LM head (all of them, or a frequency-ranked subset,
/// FR-Spec: Zhao et al. 2025), as a dense `[rows, hidden]` f32 matrix, and the token id of each
/// row. Drafting over a subset keeps exactness: the target still verifies over the full
/// vocabulary.
#[derive(Debug, Clone)]
pub struct DraftVocab {
    pub rows: Tensor,
    /// For drafting: `rows` in Q8_0 on our kernels ([`DraftVocab::quantize_for_drafting`]).
    pub fast: Option<Arc<Linear>>,
    /// `None`: row `i` is token `i` (the full vocabulary).
    pub ids: Option<Vec<u32>>,
    pub vocab_size: usize,
}

impl DraftVocab {
    /// The target's LM head rows for `ids` (`None` = every token).
    pub fn from_target(model: &Model, ids: Option<Vec<u32>>) -> Result<Self> {
        let v = model.config().vocab_size;
        if let Some(bad) = ids.as_ref().and_then(|ids| ids.iter().find(|&&t| t as usize >= v)) {
            bail!("draft vocabulary token {bad} is outside the target's vocabulary ({v} tokens)");
        }
        let all: Vec<u32>;
        let pick = match &ids {
            Some(ids) => ids.as_slice(),
            None => {
                all = (0..v as u32).collect();
                &all
            }
        };
        let rows = model.lm_head_rows(pick)?;
        Ok(Self {
            rows,
            fast: None,
            ids,
            vocab_size: v,
        })
    }

    /// The draft vocabulary a head file declares (its optional integer tensor `draft_vocab`), as
    /// rows of `target`'s LM head, quantized for drafting. Errors name the file.
    pub fn for_drafting(t: &NamedTensors, target: &Model) -> Result<Self> {
        let ids = match t.map.get("draft_vocab") {
            None => None,
            Some(ids) => Some(
                ids.to_dtype(DType::I64)
                    .and_then(|x| x.flatten_all()?.to_vec1::<i64>())
                    .with_context(|| format!("{}: tensor 'draft_vocab' is not a list of token ids", t.file))?
                    .into_iter()
                    .map(|x| u32::try_from(x).unwrap_or(u32::MAX))
                    .collect::<Vec<u32>>(),
            ),
        };
        let mut v = Self::from_target(target, ids).with_context(|| format!("{}: draft_vocab", t.file))?;
        v.quantize_for_drafting()?;
        Ok(v)
    }

    /// `ids` as the `draft_vocab` tensor a head file stores.
    pub fn ids_tensor(ids: &[u32]) -> Result<Tensor> {
        let v: Vec<i64> = ids.iter().map(|&t| t as i64).collect();
        let n = v.len();
        Ok(Tensor::from_vec(v, n, &Device::Cpu)?)
    }

    /// The draft token of one draft row (`[rows]`, over this vocabulary), its distribution
    /// when sampling, and the drafter's probability of it, as [`super::DraftSampling::pick`]
    /// gives them on the full-vocabulary row. A greedy request without a logit bias takes the
    /// argmax of the draft row itself (no full row is built).
    pub fn pick_with_confidence(&self, row: &[f32], sampling: &mut super::DraftSampling) -> ConfidentPick {
        let greedy = |row: &[f32]| {
            let i = crate::sampling::argmax(row) as usize;
            (self.token(i), None, super::softmax_probability(row, i))
        };
        if !sampling.is_sampling() {
            if !sampling.has_bias() {
                return greedy(row);
            }
            // A subset in id order: the bias by subset index (binary search), no full row; the
            // argmax's first index is then its first id, as on the full row.
            if let Some(ids) = self.ids.as_ref().filter(|ids| ids.windows(2).all(|w| w[0] < w[1])) {
                let mut biased = row.to_vec();
                for &(t, b) in sampling.bias() {
                    if let Ok(i) = ids.binary_search(&t) {
                        biased[i] += b;
                    }
                }
                return greedy(&biased);
            }
        }
        sampling.pick(&mut self.full_row(row))
    }

    /// [`DraftVocab::pick_with_confidence`] with the row masked by `guide` for the draft
    /// position after `drafted` (on the full-vocabulary row, when the guide masks): `None` when
    /// the mask leaves no token of this vocabulary ([`super::DraftSampling::pick_guided`]).
    pub fn pick_guided(
        &self,
        row: &[f32],
        sampling: &mut super::DraftSampling,
        drafted: &[u32],
        guide: &mut dyn super::DraftGuide,
    ) -> Option<ConfidentPick> {
        if !guide.masks() {
            return Some(self.pick_with_confidence(row, sampling));
        }
        sampling.pick_guided(&mut self.full_row(row), drafted, guide)
    }

    /// Use a Q8_0 copy of the rows from now on (drafting, not training).
    pub fn quantize_for_drafting(&mut self) -> Result<()> {
        self.fast = quantize_as(&self.rows, None, GgmlDType::Q8_0)?;
        Ok(())
    }

    /// Logits `[.., rows]` of normed hidden states `[.., hidden]`.
    pub fn logits(&self, h: &Tensor) -> Result<Tensor> {
        if let Some(f) = &self.fast {
            let mut dims = h.dims().to_vec();
            let inp = dims.pop().unwrap_or(1);
            let rows: usize = dims.iter().product();
            let y = f.forward(&h.reshape((rows, inp))?)?;
            dims.push(y.dim(1)?);
            return Ok(y.reshape(dims)?);
        }
        Ok(match h.rank() {
            2 => h.matmul(&self.rows.t()?)?,
            _ => h.broadcast_matmul(&self.rows.t()?)?,
        })
    }

    /// The token id of draft row `i`.
    pub fn token(&self, i: usize) -> u32 {
        match &self.ids {
            Some(ids) => ids[i],
            None => i as u32,
        }
    }

    /// A full-vocabulary logits row from a draft row (tokens outside the subset get -inf).
    pub fn full_row(&self, row: &[f32]) -> Vec<f32> {
        match &self.ids {
            None => row.to_vec(),
            Some(ids) => {
                let mut full = vec![f32::NEG_INFINITY; self.vocab_size];
                for (&t, &l) in ids.iter().zip(row) {
                    full[t as usize] = l;
                }
                full
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Drafting path: the same layers on plain row-major f32 buffers and the quantized kernels,
// without a tensor per operation (a drafter runs one to a few rows per call, where
// per-operation overhead would dominate). Training uses the tensor path above.

/// Keys and values of one head layer for positions `pos0 .. pos0 + len`, rows of
/// `kv_heads × head_dim` (keys rotated), and the attention window the head was trained with.
#[derive(Debug, Clone, Default)]
pub struct RowCache {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub len: usize,
    /// The position of row 0.
    pub pos0: usize,
    /// A row at position p attends only to positions `> p - window` (`None`: every position).
    pub window: Option<usize>,
}

impl RowCache {
    /// An empty cache whose first row will be at position `pos0`.
    pub fn at(pos0: usize, window: Option<usize>) -> Self {
        Self {
            pos0,
            window,
            ..Self::default()
        }
    }

    /// The position after the last row.
    pub fn end(&self) -> usize {
        self.pos0 + self.len
    }

    pub fn truncate(&mut self, len: usize, width: usize) {
        if len < self.len {
            self.k.truncate(len * width);
            self.v.truncate(len * width);
            self.len = len;
        }
    }

    pub fn append(&mut self, k: &[f32], v: &[f32], n: usize) {
        self.k.extend_from_slice(k);
        self.v.extend_from_slice(v);
        self.len += n;
    }
}

/// RMSNorm of every `w.len()`-wide row of `x`.
pub fn rms_rows(x: &[f32], w: &[f32], eps: f64) -> Vec<f32> {
    let h = w.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(h) {
        let ms = row.iter().map(|&v| (v * v) as f64).sum::<f64>() / h as f64;
        let scale = (1.0 / (ms + eps).sqrt()) as f32;
        out.extend(row.iter().zip(w).map(|(&v, &wv)| v * scale * wv));
    }
    out
}

fn vec1(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.flatten_all()?.to_vec1::<f32>()?)
}

impl Dense {
    /// `m` rows → `m` rows, on the quantized copy when there is one.
    pub fn rows(&self, x: &[f32], m: usize) -> Result<Vec<f32>> {
        match &self.fast {
            Some(f) => f.forward_rows(x, m),
            None => {
                let k = x.len() / m.max(1);
                let t = Tensor::from_slice(x, (m, k), &Device::Cpu)?;
                vec1(&self.forward(&t)?)
            }
        }
    }
}

/// [`Dense::rows`] of several layers on the same input (q, k and v; gate and up): one parallel
/// pass of the kernel pool when every layer has its quantized copy
/// ([`Linear::forward_rows_many`]); the bits are each layer's own.
pub fn rows_many(layers: &[&Dense], x: &[f32], m: usize) -> Result<Vec<Vec<f32>>> {
    let fast: Option<Vec<&Linear>> = layers.iter().map(|d| d.fast.as_deref()).collect();
    match fast {
        Some(f) => Linear::forward_rows_many(&f, x, m),
        None => layers.iter().map(|d| d.rows(x, m)).collect(),
    }
}

/// `Σ a[i] b[i]` in eight interleaved partial sums (a loop the compiler vectorizes).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    const L: usize = 8;
    let mut acc = [0f32; L];
    let (ca, cb) = (a.chunks_exact(L), b.chunks_exact(L));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..L {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `e^x` for `x <= 0` (larger values are not expected): `2^n · 2^f` with `n` the nearest
/// integer to `x log2 e` and Cephes' degree-6 polynomial for `2^f` on `[-0.5, 0.5]`. Relative
/// error below 1e-5 (about 3e-6 near -87, from rounding `x log2 e` to f32); `x` below -87
/// (also -inf, NaN) gives about 1.6e-38. Branch-free, so loops over it vectorize. For a
/// drafter's own softmax (attention, confidence): never the target's arithmetic.
#[inline(always)]
pub fn exp_nonpositive(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23: adding it rounds to an integer
    let y = x.max(-87.0) * std::f32::consts::LOG2_E;
    let r = y + MAGIC;
    let n = r.to_bits() as i32 - MAGIC.to_bits() as i32;
    let f = y - (r - MAGIC);
    let p = 1.535_336_2e-4_f32;
    let p = p * f + 1.339_887_4e-3;
    let p = p * f + 9.618_437e-3;
    let p = p * f + 5.550_332_5e-2;
    let p = p * f + 2.402_264_8e-1;
    let p = p * f + 6.931_472e-1;
    let p = p * f + 1.0;
    f32::from_bits((p.to_bits() as i32 + (n << 23)) as u32)
}

impl DraftVocab {
    /// Draft-vocabulary logits of `m` normed rows.
    pub fn logits_rows(&self, h: &[f32], m: usize) -> Result<Vec<f32>> {
        match &self.fast {
            Some(f) => f.forward_rows(h, m),
            None => {
                let k = h.len() / m.max(1);
                vec1(&self.logits(&Tensor::from_slice(h, (m, k), &Device::Cpu)?)?)
            }
        }
    }
}

impl HeadBlock {
    /// Rotate rows of `heads × head_dim` at `positions` in place.
    fn rope_rows(&self, x: &mut [f32], heads: usize, positions: &[usize]) {
        let d = self.shape.head_dim;
        let half = d / 2;
        let inter = self.shape.interleaved();
        let inv: Vec<f64> = (0..half)
            .map(|i| self.shape.rope_theta.powf(-2.0 * i as f64 / d as f64))
            .collect();
        for (row, &p) in x.chunks_exact_mut(heads * d).zip(positions) {
            for (i, &inv) in inv.iter().enumerate() {
                let (sin, cos) = ((p as f64) * inv).sin_cos();
                let (sin, cos) = (sin as f32, cos as f32);
                for head in row.chunks_exact_mut(d) {
                    let (a, b) = if inter { (2 * i, 2 * i + 1) } else { (i, i + half) };
                    let (x0, x1) = (head[a], head[b]);
                    head[a] = x0 * cos - x1 * sin;
                    head[b] = x0 * sin + x1 * cos;
                }
            }
        }
    }

    /// Keys and values (rows of `kv_heads × head_dim`, keys rotated) of normed rows `x` at
    /// `positions`.
    pub fn kv_rows(&self, x: &[f32], positions: &[usize]) -> Result<(Vec<f32>, Vec<f32>)> {
        let n = positions.len();
        let k = self.keys_from(self.k.rows(x, n)?, positions)?;
        Ok((k, self.v.rows(x, n)?))
    }

    /// Key projections `k` of rows at `positions` → the cached keys: k-norm (when the block has
    /// one), then RoPE.
    fn keys_from(&self, mut k: Vec<f32>, positions: &[usize]) -> Result<Vec<f32>> {
        if let Some(kn) = &self.k_norm {
            k = rms_rows(&k, &vec1(kn)?, self.shape.rms_norm_eps);
        }
        self.rope_rows(&mut k, self.shape.num_key_value_heads, positions);
        Ok(k)
    }

    /// [`HeadBlock::forward`] on rows: `x` (`n` rows at `positions`) attends to the `cache` and
    /// to the new rows (causally or both ways); the new rows' keys and values are appended to
    /// the cache. Returns the block's output rows.
    pub fn forward_rows(&self, x: &[f32], positions: &[usize], cache: &mut RowCache, causal: bool) -> Result<Vec<f32>> {
        let s = &self.shape;
        let (n, h, d) = (positions.len(), s.hidden_size, s.head_dim);
        let (hq, hk) = (s.num_attention_heads, s.num_key_value_heads);
        let eps = s.rms_norm_eps;
        let hn = rms_rows(x, &vec1(&self.attn_norm)?, eps);
        let [mut q, k, v]: [Vec<f32>; 3] = rows_many(&[&self.q, &self.k, &self.v], &hn, n)?
            .try_into()
            .map_err(|_| anyhow!("q, k and v: expected three products"))?;
        if let Some(qn) = &self.q_norm {
            q = rms_rows(&q, &vec1(qn)?, eps);
        }
        self.rope_rows(&mut q, hq, positions);
        let k = self.keys_from(k, positions)?;
        let m = cache.len;
        cache.append(&k, &v, n);
        let (kw, rep) = (hk * d, hq / hk);
        let scale = 1.0 / (d as f32).sqrt();
        let mut att = vec![0f32; n * hq * d];
        let mut scores = Vec::with_capacity(m + n);
        for i in 0..n {
            let visible = if causal { m + i + 1 } else { m + n };
            // The trained window: keys at positions > p - window.
            let first = cache
                .window
                .map_or(0, |w| (positions[i] + 1).saturating_sub(w).saturating_sub(cache.pos0))
                .min(visible);
            for head in 0..hq {
                let g = head / rep;
                let qv = &q[(i * hq + head) * d..(i * hq + head + 1) * d];
                scores.clear();
                let mut max = f32::NEG_INFINITY;
                for j in first..visible {
                    let kv = &cache.k[j * kw + g * d..j * kw + (g + 1) * d];
                    let sc = dot(qv, kv) * scale;
                    max = max.max(sc);
                    scores.push(sc);
                }
                for sc in scores.iter_mut() {
                    *sc = exp_nonpositive(*sc - max);
                }
                let sum: f32 = scores.iter().sum();
                let out = &mut att[(i * hq + head) * d..(i * hq + head + 1) * d];
                for (j, &p) in (first..).zip(scores.iter()) {
                    let vv = &cache.v[j * kw + g * d..j * kw + (g + 1) * d];
                    let p = p / sum;
                    for (o, &vx) in out.iter_mut().zip(vv) {
                        *o += p * vx;
                    }
                }
            }
        }
        let o = self.o.rows(&att, n)?;
        let mut x: Vec<f32> = x.iter().zip(&o).map(|(a, b)| a + b).collect();
        let hn = rms_rows(&x, &vec1(&self.ffn_norm)?, eps);
        let [g, u]: [Vec<f32>; 2] = rows_many(&[&self.gate, &self.up], &hn, n)?
            .try_into()
            .map_err(|_| anyhow!("gate and up: expected two products"))?;
        let act: Vec<f32> = g.iter().zip(&u).map(|(&g, &u)| g / (1.0 + (-g).exp()) * u).collect();
        let down = self.down.rows(&act, n)?;
        for (xv, dv) in x.iter_mut().zip(&down) {
            *xv += dv;
        }
        debug_assert_eq!(x.len(), n * h);
        Ok(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A draft vocabulary of a subset picks in the full vocabulary's ids: the argmax of the
    /// draft row without a bias; with one, the biased argmax among the subset's tokens (a token
    /// outside the subset stays out, whatever its bias).
    #[test]
    fn a_subset_pick_adds_the_logit_bias_by_token_id() {
        let vocab = DraftVocab {
            rows: Tensor::zeros((3, 4), DType::F32, &Device::Cpu).expect("rows"),
            fast: None,
            ids: Some(vec![2, 5, 7]),
            vocab_size: 10,
        };
        let row = [0.5f32, 1.0, 0.2];
        let pick = |bias: Vec<(u32, f32)>| {
            let params = crate::sampling::SamplingParams::greedy()
                .with_logit_bias(bias)
                .expect("bias");
            vocab.pick_with_confidence(&row, &mut super::super::DraftSampling::new(&params, 0))
        };
        assert_eq!(pick(vec![]).0, 5);
        let (t, q, c) = pick(vec![(7, 2.0)]);
        assert_eq!((t, q), (7, None));
        // softmax of [0.5, 1.0, 2.2] at 2.2.
        let e = [0.5f32 - 2.2, 1.0 - 2.2, 0.0].map(f32::exp);
        assert!((c - e[2] / e.iter().sum::<f32>()).abs() < 1e-5, "{c}");
        assert_eq!(pick(vec![(3, 100.0), (9, 50.0)]).0, 5);
        // A subset not in id order takes the full row: the same picks.
        let unordered = DraftVocab {
            ids: Some(vec![7, 2, 5]),
            ..vocab.clone()
        };
        let row = [0.2f32, 0.5, 1.0];
        let params = crate::sampling::SamplingParams::greedy()
            .with_logit_bias(vec![(7, 2.0)])
            .expect("bias");
        let (t, _, c2) = unordered.pick_with_confidence(&row, &mut super::super::DraftSampling::new(&params, 0));
        assert_eq!(t, 7);
        assert!((c2 - c).abs() < 1e-6, "{c2} vs {c}");
    }

    fn rand(shape: &[usize], seed: &mut u64) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| {
                *seed ^= *seed << 13;
                *seed ^= *seed >> 7;
                *seed ^= *seed << 17;
                ((*seed >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32 * 0.3
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).expect("tensor")
    }

    fn block(rope_style: &str, qk_norm: bool) -> HeadBlock {
        let mut s = 42u64;
        let (h, f, hq, hk, d) = (64, 96, 4, 2, 16);
        let shape = BlockShape {
            hidden_size: h,
            intermediate_size: f,
            num_attention_heads: hq,
            num_key_value_heads: hk,
            head_dim: d,
            rms_norm_eps: 1e-6,
            rope_theta: 10_000.0,
            rope_style: rope_style.into(),
        };
        let mut lin =
            |o: usize, i: usize, bias: bool| Dense::new(rand(&[o, i], &mut s), bias.then(|| rand(&[o], &mut s)));
        let (q, k, v, o) = (
            lin(hq * d, h, true),
            lin(hk * d, h, true),
            lin(hk * d, h, true),
            lin(h, hq * d, false),
        );
        let (gate, up, down) = (lin(f, h, false), lin(f, h, false), lin(h, f, false));
        let norm = |n: usize, s: &mut u64| (rand(&[n], s) + 1.0).expect("norm");
        HeadBlock {
            shape,
            attn_norm: norm(h, &mut s),
            q,
            k,
            v,
            o,
            q_norm: qk_norm.then(|| norm(d, &mut s)),
            k_norm: qk_norm.then(|| norm(d, &mut s)),
            ffn_norm: norm(h, &mut s),
            gate,
            up,
            down,
        }
    }

    #[test]
    fn fast_exp_and_dot_are_accurate() {
        for i in 0..=20_000 {
            let x = -(i as f32) * 0.0045; // 0 down to -90
            let (got, want) = (exp_nonpositive(x), x.exp());
            let tol = 1e-5 * want + 1e-37; // x log2 e rounds to f32: about 3e-6 at x = -87
            assert!((got - want).abs() <= tol, "exp({x}) = {got}, want {want}");
        }
        assert_eq!(exp_nonpositive(0.0), 1.0);
        let a: Vec<f32> = (0..67).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..67).map(|i| (i as f32 * 0.11).cos()).collect();
        let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
        assert!((dot(&a, &b) as f64 - want).abs() < 1e-5);
    }

    /// The drafting path (rows) computes what the training path (tensors) computes: same block,
    /// a past of 5 rows then 3 new rows, causal and bidirectional, both RoPE styles.
    #[test]
    fn row_path_matches_tensor_path() {
        for (style, qk) in [("neox", false), ("interleaved", true)] {
            let b = block(style, qk);
            let mut seed = 7u64;
            let past_x = rand(&[1, 5, 64], &mut seed);
            let x = rand(&[1, 3, 64], &mut seed);
            for (mask, causal) in [(AttnMask::Causal, true), (AttnMask::Bidirectional, false)] {
                let (_, pk, pv) = b.forward(&past_x, &span(10, 5), None, &AttnMask::Causal).expect("past");
                let (want, _, _) = b
                    .forward(&x, &span(15, 3), Some((&pk, &pv)), &mask)
                    .expect("tensor path");
                let mut cache = RowCache::default();
                let px = past_x.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("vec");
                b.forward_rows(&px, &span(10, 5), &mut cache, true).expect("rows past");
                let xv = x.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("vec");
                let got = b.forward_rows(&xv, &span(15, 3), &mut cache, causal).expect("row path");
                let want = want.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("vec");
                let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(err < 1e-3, "{style} {mask:?}: max abs difference {err}");
                assert_eq!(cache.len, 8);
            }
        }
    }
}
