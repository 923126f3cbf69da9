//! Multi-token-prediction (MTP) head drafter (DeepSeek-V3 technical report, §2.2).
//!
//! For the target's hidden state `h_j` at position `j` and the next token `t_{j+1}`, the head
//! computes `h'_j = Block(W_proj [RMSNorm_e(embed(t_{j+1})) ; RMSNorm_h(h_j)])` and predicts
//! `t_{j+2}` from `lm_head(RMSNorm(h'_j))`, with the target's embedding and LM head shared.
//! Drafting chains it: `h'` and the drafted token feed the next step, so one head drafts any
//! depth D. The head's block attends causally over its own KV cache of earlier positions.
//!
//! Which target hidden state feeds the head is part of its contract (`hidden_source` in the
//! head's config): `pre_norm` (the last block's output, DeepSeek-V3's choice, the default) or
//! `post_norm` (after the target's final norm). A head may instead read *fused features*
//! (EAGLE-3, Li et al. 2025, §3): the outputs of several target blocks (`target_layer_ids`,
//! shallow to deep) concatenated and projected by `hidden_fc` (`[hidden, L × hidden]`) to one
//! hidden state, which then takes `h_j`'s place; chained steps feed the head's own `h'` as
//! before.
//!
//! Tensor layouts (see [`crate::inspect`]): DeepSeek-V3 (`model.layers.{L}.enorm`, `hnorm`,
//! `eh_proj`, `shared_head.norm`, optional `shared_head.head`, and the block under the same
//! prefix) and Qwen3-Next (`mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.fc`,
//! `mtp.norm`, block `mtp.layers.0.*`). A head with several MTP layers drafts with the first,
//! chained. An optional `draft_vocab` integer tensor lists the token ids of a reduced draft
//! vocabulary (FR-Spec, Zhao et al. 2025): the head then pays for those LM head rows only.

use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};

use super::head::{
    block_tensors, catch_up_share, rms_norm, rms_rows, span, AttnMask, BlockShape, Dense, DraftVocab, HeadBlock,
    NamedTensors, RowCache,
};
use super::{Drafter, Proposal};
use crate::arch::BundleFormat;
use crate::model::{Embedding, Model};
use crate::sampling::SamplingParams;

/// Which target hidden state an MTP head reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum HiddenSource {
    /// The last block's output, before the final norm (DeepSeek-V3).
    #[default]
    PreNorm,
    /// After the target's final norm.
    PostNorm,
}

impl HiddenSource {
    /// The [`Model::forward`] tap that gives this hidden state.
    pub fn tap(self, num_layers: usize) -> usize {
        match self {
            Self::PreNorm => num_layers - 1,
            Self::PostNorm => num_layers,
        }
    }
}

/// Tensor naming of an MTP head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MtpLayout {
    DeepseekV3,
    Qwen3Next,
}

/// An MTP head's `config.json` (every field optional: a missing shape is the target's).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct MtpConfig {
    #[serde(default)]
    pub model_type: Option<String>,
    /// MTP layers in the file (DeepSeek-V3's marker).
    #[serde(default)]
    pub num_nextn_predict_layers: Option<usize>,
    #[serde(default)]
    pub hidden_source: HiddenSource,
    /// Fused features (EAGLE-3): the target blocks whose outputs the head reads, shallow to
    /// deep, through `hidden_fc`. `None`: the one hidden state `hidden_source` names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_layer_ids: Option<Vec<usize>>,
    #[serde(default, flatten)]
    pub shape: Option<BlockShape>,
    /// The target's layer count (DeepSeek-V3 names the MTP layer after the trunk's layers).
    #[serde(default)]
    pub num_hidden_layers: Option<usize>,
    #[serde(default)]
    pub vocab_size: Option<usize>,
    /// Positions a row attends to, itself included (`specula distill` trains on windows of this
    /// many rows); `None`: every earlier position.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_window: Option<usize>,
    /// What `specula distill` recorded: data, steps, final loss, held-out acceptance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub training: Option<serde_json::Value>,
}

/// The weights of an MTP head (dense f32), borrowing the target's embedding and LM head rows.
#[derive(Debug, Clone)]
pub struct MtpWeights {
    pub enorm: Tensor,
    pub hnorm: Tensor,
    /// `[hidden, 2 × hidden]`, input `[embedding ; hidden state]`.
    pub eh_proj: Dense,
    /// Fused features: `[hidden, L × hidden]`, the `L` tapped target hidden states
    /// (concatenated, shallow to deep) → the hidden state the head reads. `None`: one tap.
    pub hidden_fc: Option<Dense>,
    pub block: HeadBlock,
    /// The norm before the LM head (`shared_head.norm`).
    pub norm: Tensor,
}

impl MtpWeights {
    /// The weights under `prefix` in DeepSeek-V3 names (`enorm`, `hnorm`, `eh_proj`,
    /// `shared_head.norm`, the block, and `hidden_fc` for a head of `fused` taps). Errors name
    /// the file, the tensor and the shapes.
    pub fn from_named(t: &NamedTensors, prefix: &str, shape: &BlockShape, fused: Option<usize>) -> Result<Self> {
        let (p, h) = (prefix, shape.hidden_size);
        Ok(Self {
            hidden_fc: hidden_fc(t, &format!("{p}hidden_fc.weight"), h, fused)?,
            enorm: t.get(&format!("{p}enorm.weight"), &[h], "the embedding norm")?,
            hnorm: t.get(&format!("{p}hnorm.weight"), &[h], "the hidden-state norm")?,
            eh_proj: Dense::new(
                t.get(
                    &format!("{p}eh_proj.weight"),
                    &[h, 2 * h],
                    "hidden × [embedding ; hidden state]",
                )?,
                None,
            ),
            block: t.block(p, shape)?,
            norm: t.get(&format!("{p}shared_head.norm.weight"), &[h], "the final norm")?,
        })
    }

    /// The hidden state the head's first step reads, from the tapped target hidden states
    /// `taps` (`[.., L × hidden]`, concatenated shallow to deep): `hidden_fc(taps)` for a
    /// fused-feature head, else `taps` itself (`L` = 1).
    pub fn features(&self, taps: &Tensor) -> Result<Tensor> {
        match &self.hidden_fc {
            Some(fc) => fc.forward(taps),
            None => Ok(taps.clone()),
        }
    }

    /// [`MtpWeights::features`] on `n` rows (the drafting path).
    pub fn features_rows(&self, taps: &[f32], n: usize) -> Result<Vec<f32>> {
        match &self.hidden_fc {
            Some(fc) => fc.rows(taps, n),
            None => Ok(taps.to_vec()),
        }
    }

    /// Use quantized copies of the projections for drafting ([`Dense::quantize_for_drafting`]).
    pub fn quantize_for_drafting(&mut self) -> Result<()> {
        self.eh_proj.quantize_for_drafting()?;
        if let Some(fc) = self.hidden_fc.as_mut() {
            fc.quantize_for_drafting()?;
        }
        self.block.quantize_for_drafting()
    }

    /// One step of the head: `emb`, `hidden` (`[b, n, h]`, rows at positions `pos0 ..`) →
    /// the block's output `h'` (`[b, n, h]`, before the final norm) and the new keys and values.
    pub fn forward(
        &self,
        emb: &Tensor,
        hidden: &Tensor,
        pos0: usize,
        past: Option<(&Tensor, &Tensor)>,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        self.forward_masked(emb, hidden, &span(pos0, emb.dim(1)?), past, &AttnMask::Causal)
    }

    /// [`MtpWeights::forward`] with rows at any `positions` and any attention `mask` (training
    /// a chained step against the first step's keys and values).
    pub fn forward_masked(
        &self,
        emb: &Tensor,
        hidden: &Tensor,
        positions: &[usize],
        past: Option<(&Tensor, &Tensor)>,
        mask: &AttnMask,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let eps = self.block.shape.rms_norm_eps;
        let x = Tensor::cat(
            &[&rms_norm(emb, &self.enorm, eps)?, &rms_norm(hidden, &self.hnorm, eps)?],
            2,
        )?;
        let x = self.eh_proj.forward(&x)?;
        self.block.forward(&x, positions, past, mask)
    }

    /// [`MtpWeights::forward`] on rows (the drafting path): `emb`, `hidden` (`n` rows each at
    /// `pos0 ..`) → `h'` rows, appending keys and values to `cache`.
    pub fn forward_rows(&self, emb: &[f32], hidden: &[f32], pos0: usize, cache: &mut RowCache) -> Result<Vec<f32>> {
        let h = self.block.shape.hidden_size;
        let eps = self.block.shape.rms_norm_eps;
        let n = emb.len() / h;
        let e = rms_rows(emb, &self.enorm.to_vec1::<f32>()?, eps);
        let hd = rms_rows(hidden, &self.hnorm.to_vec1::<f32>()?, eps);
        let mut x = Vec::with_capacity(n * 2 * h);
        for r in 0..n {
            x.extend_from_slice(&e[r * h..(r + 1) * h]);
            x.extend_from_slice(&hd[r * h..(r + 1) * h]);
        }
        let x = self.eh_proj.rows(&x, n)?;
        self.block.forward_rows(&x, &span(pos0, n), cache, true)
    }

    /// The tensors in DeepSeek-V3 naming under `model.layers.{layer}.`, for writing.
    pub fn tensors(&self, layer: usize) -> Vec<(String, Tensor)> {
        let p = BundleFormat::Hf.layer_prefix(layer);
        let mut v = block_tensors(&self.block, &p);
        v.push((format!("{p}enorm.weight"), self.enorm.clone()));
        v.push((format!("{p}hnorm.weight"), self.hnorm.clone()));
        v.push((format!("{p}eh_proj.weight"), self.eh_proj.w.clone()));
        v.push((format!("{p}shared_head.norm.weight"), self.norm.clone()));
        if let Some(fc) = &self.hidden_fc {
            v.push((format!("{p}hidden_fc.weight"), fc.w.clone()));
        }
        v
    }
}

/// The fused-feature projection `name` (`[h, fused × h]`) of a head that reads `fused` taps;
/// for a one-tap head, an error if the file has one anyway (its config would be missing
/// `target_layer_ids`).
fn hidden_fc(t: &NamedTensors, name: &str, h: usize, fused: Option<usize>) -> Result<Option<Dense>> {
    match fused {
        Some(l) => Ok(Some(Dense::new(
            t.get(
                name,
                &[h, l * h],
                "hidden × (target layers × hidden), the fused features",
            )?,
            None,
        ))),
        None if t.map.contains_key(name) => bail!(
            "{}: {name} holds fused features, but the head's config names no target_layer_ids",
            t.file
        ),
        None => Ok(None),
    }
}

/// A loaded MTP head, ready to draft for its target.
#[derive(Debug)]
pub struct MtpHead {
    pub config: MtpConfig,
    pub layout: MtpLayout,
    pub weights: MtpWeights,
    pub vocab: DraftVocab,
    /// The target's embedding table (shared).
    pub embedding: Embedding,
    /// The target taps this head reads: one (`hidden_source`), or the fused features'
    /// `target_layer_ids`.
    pub taps: Vec<usize>,
    /// Where it was loaded from.
    pub source: String,
}

impl MtpHead {
    /// Load an MTP head for `target` from `path`: a directory (config.json + safetensors) or one
    /// safetensors file. Errors name the file and the tensor or field: no MTP tensors in either
    /// layout, a shape that does not fit the target (hidden size, heads, vocabulary).
    pub fn load(path: &Path, target: &Model) -> Result<Self> {
        let cfg_path = if path.is_dir() {
            Some(path.join("config.json"))
        } else {
            None
        };
        let config: MtpConfig = match cfg_path.as_ref().filter(|p| p.exists()) {
            Some(p) => {
                let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
                serde_json::from_str(&text).with_context(|| format!("{}: not a valid MTP head config", p.display()))?
            }
            None => MtpConfig::default(),
        };
        let tensors = NamedTensors::read(path)?;
        Self::from_tensors(config, &tensors, target)
    }

    /// As [`MtpHead::load`], from read tensors.
    pub fn from_tensors(config: MtpConfig, t: &NamedTensors, target: &Model) -> Result<Self> {
        let tc = target.config();
        let shape = config.shape.clone().unwrap_or_else(|| BlockShape::of_target(target));
        if shape.hidden_size != tc.hidden_size {
            bail!(
                "{}: hidden_size {} does not match the target's hidden size {}",
                t.file,
                shape.hidden_size,
                tc.hidden_size
            );
        }
        if let Some(v) = config.vocab_size.filter(|&v| v != tc.vocab_size) {
            bail!(
                "{}: vocab_size {v} does not match the target's vocabulary ({} tokens)",
                t.file,
                tc.vocab_size
            );
        }
        let h = shape.hidden_size;
        let taps = match &config.target_layer_ids {
            Some(ids) => {
                if ids.is_empty() {
                    bail!("{}: target_layer_ids is empty", t.file);
                }
                if let Some(&bad) = ids.iter().find(|&&l| l >= tc.num_layers) {
                    bail!(
                        "{}: target_layer_ids names layer {bad}, but the target has layers 0..{}",
                        t.file,
                        tc.num_layers
                    );
                }
                ids.clone()
            }
            None => vec![config.hidden_source.tap(tc.num_layers)],
        };
        let fused = config.target_layer_ids.as_ref().map(Vec::len);
        // DeepSeek-V3: the lowest `model.layers.{N}.` holding `eh_proj`.
        let ds_layer = t
            .map
            .keys()
            .filter_map(|k| {
                let (n, rest) = BundleFormat::Hf.split_layer(k)?;
                (rest == "eh_proj.weight").then_some(n)
            })
            .min();
        let (layout, weights) = if let Some(l) = ds_layer {
            (
                MtpLayout::DeepseekV3,
                MtpWeights::from_named(t, &BundleFormat::Hf.layer_prefix(l), &shape, fused)?,
            )
        } else if t.map.keys().any(|k| k.starts_with("mtp.")) {
            (
                MtpLayout::Qwen3Next,
                MtpWeights {
                    enorm: t.get("mtp.pre_fc_norm_embedding.weight", &[h], "the embedding norm")?,
                    hnorm: t.get("mtp.pre_fc_norm_hidden.weight", &[h], "the hidden-state norm")?,
                    eh_proj: Dense::new(
                        t.get("mtp.fc.weight", &[h, 2 * h], "hidden × [embedding ; hidden state]")?,
                        None,
                    ),
                    hidden_fc: hidden_fc(t, "mtp.hidden_fc.weight", h, fused)?,
                    block: t.block("mtp.layers.0.", &shape)?,
                    norm: t.get("mtp.norm.weight", &[h], "the final norm")?,
                },
            )
        } else {
            bail!(
                "{}: no MTP head tensors (neither model.layers.N.eh_proj.weight, DeepSeek-V3 layout, nor mtp.fc.weight, Qwen3-Next layout)",
                t.file
            );
        };
        let vocab = DraftVocab::for_drafting(t, target)?;
        // Drafting reads quantized copies of the weights (Q5_0 projections, the Q8_0 draft LM head).
        let mut weights = weights;
        weights.quantize_for_drafting()?;
        Ok(Self {
            config: MtpConfig {
                shape: Some(shape),
                ..config
            },
            layout,
            weights,
            vocab,
            embedding: target.embedding.clone(),
            taps,
            source: t.file.clone(),
        })
    }

    /// Draft-vocabulary logits of `h'` rows (`[.., hidden]`).
    pub fn logits(&self, h: &Tensor) -> Result<Tensor> {
        let n = rms_norm(h, &self.weights.norm, self.weights.block.shape.rms_norm_eps)?;
        self.vocab.logits(&n)
    }
}

/// An MTP head's per-request state: the target hidden states of committed positions and the
/// head's own KV cache.
pub struct MtpDrafter {
    head: Arc<MtpHead>,
    /// Target hidden rows for positions `base .. base + n_hidden`, row-major, each the taps'
    /// states concatenated (`taps × hidden` values).
    hidden: Vec<f32>,
    base: usize,
    /// The head's cache holds rows computed from committed inputs up to this position
    /// (exclusive); rows past it came from a draft chain and are dropped at the next proposal.
    kv_true_end: usize,
    cache: RowCache,
    sampling: super::DraftSampling,
    /// Tokens of the last proposal, and the catch-up seconds of the last proposal
    /// ([`Drafter::last_catch_up_s`]).
    last_draft: usize,
    catch_up_s: f64,
}

impl MtpDrafter {
    /// A drafter for one request: greedy drafts for greedy requests, else drafts sampled with
    /// the request's temperature and filters (penalties off) from an RNG seeded by `seed`.
    pub fn new(head: Arc<MtpHead>, params: &SamplingParams, seed: u64) -> Self {
        let sampling = super::DraftSampling::new(params, seed);
        Self {
            head,
            hidden: Vec::new(),
            base: 0,
            kv_true_end: 0,
            cache: RowCache::default(),
            sampling,
            last_draft: 0,
            catch_up_s: 0.0,
        }
    }

    fn hidden_size(&self) -> usize {
        self.head.weights.block.shape.hidden_size
    }

    fn kv_width(&self) -> usize {
        let s = &self.head.weights.block.shape;
        s.num_key_value_heads * s.head_dim
    }

    /// Values per position in `hidden`.
    fn row_width(&self) -> usize {
        self.head.taps.len() * self.hidden_size()
    }

    fn n_hidden(&self) -> usize {
        self.hidden.len() / self.row_width()
    }

    fn embed(&self, ids: &[u32]) -> Result<Vec<f32>> {
        Ok(self
            .head
            .embedding
            .forward(ids, &Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    }

    /// The next draft token from `h'` (one row), its distribution when sampling, and the
    /// head's probability of it.
    /// `None` when `guide`'s mask leaves no token after `drafted`.
    fn pick(
        &mut self,
        h_last: &[f32],
        drafted: &[u32],
        guide: &mut dyn super::DraftGuide,
    ) -> Result<Option<super::head::ConfidentPick>> {
        let eps = self.head.weights.block.shape.rms_norm_eps;
        let normed = rms_rows(h_last, &self.head.weights.norm.to_vec1::<f32>()?, eps);
        let row = self.head.vocab.logits_rows(&normed, 1)?;
        Ok(self.head.vocab.pick_guided(&row, &mut self.sampling, drafted, guide))
    }
}

impl Drafter for MtpDrafter {
    fn propose(&mut self, context: &[u32], k: usize) -> Result<Proposal> {
        self.propose_guided(context, k, &mut super::Unguided)
    }

    fn propose_guided(&mut self, context: &[u32], k: usize, guide: &mut dyn super::DraftGuide) -> Result<Proposal> {
        // The first draft token is at sequence position context.len() (coupled draws).
        self.sampling.begin(context.len());
        let n = context.len();
        let hs = self.hidden_size();
        self.catch_up_s = 0.0;
        let last_draft = std::mem::take(&mut self.last_draft);
        // The head at position j reads h_j and t_{j+1}: committed rows j = base .. n - 2.
        if k == 0 || n < 2 || self.n_hidden() == 0 || self.base + self.n_hidden() < n - 1 {
            return Ok(Proposal::default());
        }
        let width = self.kv_width();
        let last = n - 2;
        // Rows before `lo` are outside the trained attention window of every row to come.
        let window = self.head.config.attention_window;
        let lo = window.map_or(self.base, |w| (last + 1).saturating_sub(w).max(self.base));
        let from = if self.cache.len == 0 || self.kv_true_end < lo || self.cache.pos0 > self.kv_true_end {
            self.cache = RowCache::at(lo, window);
            lo
        } else {
            self.cache.truncate(self.kv_true_end - self.cache.pos0, width);
            self.kv_true_end
        };
        if from > last {
            // Nothing new was committed since the last proposal (cannot happen in the
            // sequence protocol); no draft rather than a stale one.
            return Ok(Proposal::default());
        }
        let rows = last + 1 - from;
        let emb = self.embed(&context[from + 1..=last + 1])?;
        let rw = self.row_width();
        let off = (from - self.base) * rw;
        let started = std::time::Instant::now();
        let hid = self
            .head
            .weights
            .features_rows(&self.hidden[off..off + rows * rw], rows)?;
        let out = self.head.weights.forward_rows(&emb, &hid, from, &mut self.cache)?;
        // Rows a pause (or the prompt) left unseen are catch-up, not the price of drafting.
        self.catch_up_s = catch_up_share(started.elapsed().as_secs_f64(), rows, last_draft);
        self.kv_true_end = last + 1;
        let mut h_last = out[(rows - 1) * hs..].to_vec();
        let mut tokens = Vec::with_capacity(k);
        let mut qs = Vec::with_capacity(k);
        let mut confidence = Vec::with_capacity(k);
        for i in 0..k {
            let Some((t, q, c)) = self.pick(&h_last, &tokens, guide)? else {
                break;
            };
            tokens.push(t);
            confidence.push(c);
            if let Some(q) = q {
                qs.push(q);
            }
            if i + 1 == k || !guide.go_on(&confidence) {
                break;
            }
            let emb = self.embed(&[t])?;
            h_last = self
                .head
                .weights
                .forward_rows(&emb, &h_last, n - 1 + i, &mut self.cache)?;
        }
        self.last_draft = tokens.len();
        Ok(Proposal {
            tokens,
            q: self.sampling.carries_q().then_some(qs),
            confidence: Some(confidence),
        })
    }

    fn name(&self) -> &'static str {
        "mtp"
    }

    fn couple(&mut self, key: u64) {
        self.sampling.couple(key);
    }

    fn last_catch_up_s(&self) -> f64 {
        self.catch_up_s
    }

    fn taps(&self) -> &[usize] {
        &self.head.taps
    }

    fn observe(&mut self, start: usize, n: usize, hidden: &[&[f32]]) -> Result<()> {
        let hs = self.hidden_size();
        let rw = self.row_width();
        if hidden.is_empty() {
            return Ok(());
        }
        if hidden.len() != self.head.taps.len() || hidden.iter().any(|h| h.len() != n * hs) {
            bail!("MTP head: expected {} taps of {n} rows of {hs}", self.head.taps.len());
        }
        let end = self.base + self.n_hidden();
        if self.hidden.is_empty() || start > end || start < self.base {
            // First rows, or a gap (a prefix-cache hit): start over from `start`.
            self.hidden.clear();
            self.base = start;
            self.kv_true_end = 0;
            self.cache = RowCache::default();
        } else if start < end {
            self.hidden.truncate((start - self.base) * rw);
            self.kv_true_end = self.kv_true_end.min(start.saturating_sub(1));
        }
        crate::device::append_interleaved(&mut self.hidden, hidden, n, hs);
        Ok(())
    }
}
