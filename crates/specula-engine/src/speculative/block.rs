//! Block drafter (DFlash: Chen, Liang, Liu, "Block Diffusion for Flash Speculative Decoding",
//! arXiv 2602.06036): a few transformer layers that propose a whole block of tokens in one
//! forward pass, conditioned on the target's hidden states.
//!
//! - **Context feature.** For every committed position `p`, the target's hidden states at the
//!   configured layers (`target_layer_ids`, shallow to deep; layer `i` = block `i`'s output) are
//!   concatenated and projected: `c_p = RMSNorm_hidden(fc [h^{l_1}_p ; … ; h^{l_L}_p])`.
//! - **Injection.** Every drafter layer turns `c_p` into keys and values with its own `k_proj` /
//!   `v_proj` (keys rotated at position `p`); they sit in the drafter's KV cache, extended as
//!   tokens are committed.
//! - **Block.** The anchor (the last committed token, at position `n - 1`) and `block_size - 1`
//!   mask tokens (`mask_token_id`) at positions `n - 1 ..`, embedded with the target's table, go
//!   through the layers attending to every context key and to each other in both directions;
//!   after the final norm, mask row `i` gives the logits of the token at position `n - 1 + i`
//!   (the target's LM head rows, optionally a reduced draft vocabulary).
//!
//! Layout: the `drafter/` folder's `config.json` (`block_size`, `target_layer_ids` at the top or
//! in `dflash_config`, `mask_token_id`, optional shape fields, default the target's) and
//! safetensors with `fc.weight` `[h, L × target_h]`, `hidden_norm.weight`, `norm.weight`,
//! `layers.{i}.*` (optionally under `model.`), and optionally `draft_vocab`.

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
use crate::model::{Embedding, Model};
use crate::sampling::SamplingParams;

/// A block drafter's `config.json`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct BlockConfig {
    #[serde(default)]
    pub model_type: Option<String>,
    #[serde(default)]
    pub block_size: Option<usize>,
    #[serde(default)]
    pub target_layer_ids: Option<Vec<usize>>,
    #[serde(default)]
    pub mask_token_id: Option<u32>,
    #[serde(default)]
    pub num_hidden_layers: Option<usize>,
    #[serde(default)]
    pub vocab_size: Option<usize>,
    #[serde(default, flatten)]
    pub shape: Option<BlockShape>,
    #[serde(default)]
    pub dflash_config: Option<serde_json::Value>,
    /// Context positions a block row attends to (`specula distill` trains on windows of this
    /// many rows); `None`: every earlier position.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_window: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub training: Option<serde_json::Value>,
}

/// Whether a drafter folder's `config.json` (`j`) describes a block drafter: it has
/// `block_size` or `dflash_config`, or `target_layer_ids` without an MTP marker
/// (`num_nextn_predict_layers`; a fused-feature MTP head also lists `target_layer_ids`).
pub fn is_block_drafter_config(j: &serde_json::Value) -> bool {
    j.get("block_size").is_some()
        || j.get("dflash_config").is_some()
        || (j.get("target_layer_ids").is_some() && j.get("num_nextn_predict_layers").is_none())
}

/// The weights of a block drafter (dense f32 for training, Q5_0 copies for drafting).
#[derive(Debug, Clone)]
pub struct BlockWeights {
    /// `[h, L × target_h]`.
    pub fc: Dense,
    pub hidden_norm: Tensor,
    pub layers: Vec<HeadBlock>,
    pub norm: Tensor,
}

impl BlockWeights {
    /// Read the weights (names under `prefix`, `""` or `"model."`).
    pub fn from_named(
        t: &NamedTensors,
        prefix: &str,
        shape: &BlockShape,
        n_taps: usize,
        target_h: usize,
        layers: usize,
    ) -> Result<Self> {
        let h = shape.hidden_size;
        let mut ls = Vec::with_capacity(layers);
        for i in 0..layers {
            ls.push(t.block(&format!("{prefix}layers.{i}."), shape)?);
        }
        Ok(Self {
            fc: Dense::new(
                t.get(
                    &format!("{prefix}fc.weight"),
                    &[h, n_taps * target_h],
                    "hidden × (target layers × target hidden)",
                )?,
                None,
            ),
            hidden_norm: t.get(&format!("{prefix}hidden_norm.weight"), &[h], "the context-feature norm")?,
            layers: ls,
            norm: t.get(&format!("{prefix}norm.weight"), &[h], "the final norm")?,
        })
    }

    /// The tensors by name (no prefix), for writing.
    pub fn tensors(&self) -> Vec<(String, Tensor)> {
        let mut v = vec![
            ("fc.weight".to_string(), self.fc.w.clone()),
            ("hidden_norm.weight".to_string(), self.hidden_norm.clone()),
            ("norm.weight".to_string(), self.norm.clone()),
        ];
        for (i, l) in self.layers.iter().enumerate() {
            v.extend(block_tensors(l, &format!("layers.{i}.")));
        }
        v
    }

    /// Context features `[b, n, h]` of concatenated target hidden states `[b, n, L × target_h]`.
    pub fn context(&self, taps: &Tensor) -> Result<Tensor> {
        let eps = self.layers.first().map_or(1e-6, |l| l.shape.rms_norm_eps);
        rms_norm(&self.fc.forward(taps)?, &self.hidden_norm, eps)
    }

    /// Per layer, the context keys and values of features `c` (`[b, n, h]`) at `positions`.
    pub fn context_kv(&self, c: &Tensor, positions: &[usize]) -> Result<Vec<(Tensor, Tensor)>> {
        self.layers.iter().map(|l| l.keys_values(c, positions)).collect()
    }

    /// The block rows `x` (`[b, r, h]` embeddings at `positions`) through every layer, attending
    /// to `ctx` (per layer keys and values) as `mask` says; returns the final-normed rows.
    pub fn forward(
        &self,
        x: &Tensor,
        positions: &[usize],
        ctx: &[(Tensor, Tensor)],
        mask: &AttnMask,
    ) -> Result<Tensor> {
        let mut x = x.clone();
        for (l, (k, v)) in self.layers.iter().zip(ctx) {
            x = l.forward(&x, positions, Some((k, v)), mask)?.0;
        }
        let eps = self.layers.first().map_or(1e-6, |l| l.shape.rms_norm_eps);
        rms_norm(&x, &self.norm, eps)
    }

    fn quantize_for_drafting(&mut self) -> Result<()> {
        self.fc.quantize_for_drafting()?;
        for l in self.layers.iter_mut() {
            l.quantize_for_drafting()?;
        }
        Ok(())
    }
}

/// A loaded block drafter.
#[derive(Debug)]
pub struct BlockDrafterModel {
    pub config: BlockConfig,
    pub block_size: usize,
    /// Target taps (block outputs), shallow to deep.
    pub taps: Vec<usize>,
    pub mask_token: u32,
    pub weights: BlockWeights,
    pub vocab: DraftVocab,
    pub embedding: Embedding,
    pub source: String,
}

impl BlockDrafterModel {
    /// Load a block drafter for `target` from its folder (config.json + safetensors). Errors name
    /// the file and the field or tensor: a missing `block_size`, a target layer out of range, a
    /// mask token outside the vocabulary, a tensor of the wrong shape.
    pub fn load(dir: &Path, target: &Model) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).with_context(|| format!("reading {}", cfg_path.display()))?;
        let config: BlockConfig = serde_json::from_str(&text)
            .with_context(|| format!("{}: not a valid block drafter config", cfg_path.display()))?;
        let t = NamedTensors::read(dir)?;
        Self::from_parts(config, &t, target, &cfg_path.display().to_string())
    }

    pub fn from_parts(config: BlockConfig, t: &NamedTensors, target: &Model, cfg_file: &str) -> Result<Self> {
        let tc = target.config();
        let nested = |k: &str| config.dflash_config.as_ref().and_then(|d| d.get(k)).cloned();
        let block_size = config
            .block_size
            .or_else(|| nested("block_size").and_then(|v| v.as_u64()).map(|v| v as usize))
            .with_context(|| format!("{cfg_file}: missing 'block_size'"))?;
        if !(2..=64).contains(&block_size) {
            bail!("{cfg_file}: 'block_size' {block_size} must be between 2 and 64");
        }
        let taps: Vec<usize> = match config.target_layer_ids.clone() {
            Some(v) => v,
            None => nested("target_layer_ids")
                .and_then(|v| serde_json::from_value(v).ok())
                .with_context(|| format!("{cfg_file}: missing 'target_layer_ids'"))?,
        };
        if taps.is_empty() {
            bail!("{cfg_file}: 'target_layer_ids' is empty");
        }
        if let Some(&bad) = taps.iter().find(|&&l| l >= tc.num_layers) {
            bail!(
                "{cfg_file}: 'target_layer_ids' names layer {bad}, but the target has layers 0..{}",
                tc.num_layers
            );
        }
        let mask_token = config
            .mask_token_id
            .or_else(|| nested("mask_token_id").and_then(|v| v.as_u64()).map(|v| v as u32))
            .with_context(|| format!("{cfg_file}: missing 'mask_token_id'"))?;
        if mask_token as usize >= tc.vocab_size {
            bail!(
                "{cfg_file}: 'mask_token_id' {mask_token} is outside the target's vocabulary ({} tokens)",
                tc.vocab_size
            );
        }
        if let Some(v) = config.vocab_size.filter(|&v| v != tc.vocab_size) {
            bail!(
                "{cfg_file}: 'vocab_size' {v} does not match the target's ({})",
                tc.vocab_size
            );
        }
        let shape = config.shape.clone().unwrap_or_else(|| BlockShape::of_target(target));
        if shape.hidden_size != tc.hidden_size {
            bail!(
                "{cfg_file}: 'hidden_size' {} differs from the target's {} (the drafter borrows the target's embedding and LM head)",
                shape.hidden_size,
                tc.hidden_size
            );
        }
        let prefix = if t.map.contains_key("model.fc.weight") {
            "model."
        } else {
            ""
        };
        let layers = match config.num_hidden_layers {
            Some(n) => n,
            None => (0..)
                .take_while(|i| {
                    t.map
                        .contains_key(&format!("{prefix}layers.{i}.input_layernorm.weight"))
                })
                .count(),
        };
        if layers == 0 {
            bail!("{}: no drafter layers ({prefix}layers.0.*)", t.file);
        }
        let mut weights = BlockWeights::from_named(t, prefix, &shape, taps.len(), tc.hidden_size, layers)?;
        let vocab = DraftVocab::for_drafting(t, target)?;
        weights.quantize_for_drafting()?;
        Ok(Self {
            config: BlockConfig {
                shape: Some(shape),
                ..config
            },
            block_size,
            taps,
            mask_token,
            weights,
            vocab,
            embedding: target.embedding.clone(),
            source: t.file.clone(),
        })
    }
}

/// A block drafter's per-request state: the target hidden states of committed positions and the
/// context keys and values of every drafter layer.
pub struct BlockDrafter {
    model: Arc<BlockDrafterModel>,
    /// Per tap, target hidden rows for positions `base .. base + n`, row-major.
    hidden: Vec<Vec<f32>>,
    base: usize,
    /// Context keys / values per layer (all layers cover the same positions).
    ctx: Vec<RowCache>,
    sampling: super::DraftSampling,
    /// Tokens of the last proposal, and the catch-up seconds of the last proposal
    /// ([`Drafter::last_catch_up_s`]).
    last_draft: usize,
    catch_up_s: f64,
}

impl BlockDrafter {
    pub fn new(model: Arc<BlockDrafterModel>, params: &SamplingParams, seed: u64) -> Self {
        let sampling = super::DraftSampling::new(params, seed);
        let n = model.taps.len();
        let layers = model.weights.layers.len();
        Self {
            model,
            hidden: vec![Vec::new(); n],
            base: 0,
            ctx: vec![RowCache::default(); layers],
            sampling,
            last_draft: 0,
            catch_up_s: 0.0,
        }
    }

    fn target_h(&self) -> usize {
        self.model.weights.fc.w.dim(1).unwrap_or(0) / self.model.taps.len()
    }

    fn n_hidden(&self) -> usize {
        self.hidden[0].len() / self.target_h().max(1)
    }

    fn kv_width(&self) -> usize {
        self.model
            .weights
            .layers
            .first()
            .map_or(0, |l| l.shape.num_key_value_heads * l.shape.head_dim)
    }

    /// Drop context rows at positions `>= keep`.
    fn reset_context(&mut self, keep: usize) {
        let w = self.kv_width();
        for c in self.ctx.iter_mut() {
            if keep <= c.pos0 {
                *c = RowCache::default();
            } else {
                c.truncate(keep - c.pos0, w);
            }
        }
    }

    /// Extend the context keys / values to every observed position (within the trained window
    /// of the next block); `last_catch_up_s` gets the share of rows past a steady step's.
    fn extend_context(&mut self, last_draft: usize) -> Result<()> {
        let end = self.base + self.n_hidden();
        let window = self.model.config.attention_window;
        let lo = window.map_or(self.base, |w| (end + 1).saturating_sub(w).max(self.base));
        let (have, cur_end) = (self.ctx[0].len > 0, self.ctx[0].end());
        let from = if !have || cur_end < lo {
            for c in self.ctx.iter_mut() {
                *c = RowCache::at(lo, window);
            }
            lo
        } else {
            cur_end
        };
        if from >= end {
            return Ok(());
        }
        let started = std::time::Instant::now();
        let th = self.target_h();
        let rows = end - from;
        let mut cat = Vec::with_capacity(rows * th * self.hidden.len());
        for r in from - self.base..end - self.base {
            for h in &self.hidden {
                cat.extend_from_slice(&h[r * th..(r + 1) * th]);
            }
        }
        let w = &self.model.weights;
        let eps = w.layers.first().map_or(1e-6, |l| l.shape.rms_norm_eps);
        let c = rms_rows(&w.fc.rows(&cat, rows)?, &w.hidden_norm.to_vec1::<f32>()?, eps);
        let positions = span(from, rows);
        for (layer, cache) in w.layers.iter().zip(self.ctx.iter_mut()) {
            let (k, v) = layer.kv_rows(&c, &positions)?;
            cache.append(&k, &v, rows);
        }
        self.catch_up_s = catch_up_share(started.elapsed().as_secs_f64(), rows, last_draft);
        Ok(())
    }
}

impl Drafter for BlockDrafter {
    fn propose(&mut self, context: &[u32], k: usize) -> Result<Proposal> {
        self.propose_guided(context, k, &mut super::Unguided)
    }

    /// The block's rows are computed in one pass; the guide's mask applies to each row with
    /// the tokens picked before it (`go_on` is not asked: the pass is paid already).
    fn propose_guided(&mut self, context: &[u32], k: usize, guide: &mut dyn super::DraftGuide) -> Result<Proposal> {
        // The first draft token is at sequence position context.len() (coupled draws).
        self.sampling.begin(context.len());
        let n = context.len();
        let bs = self.model.block_size;
        self.catch_up_s = 0.0;
        let last_draft = std::mem::take(&mut self.last_draft);
        // The context must cover positions up to n - 2 (the anchor n - 1 is not in the target yet).
        if k == 0 || n < 2 || self.n_hidden() == 0 || self.base + self.n_hidden() < n - 1 {
            return Ok(Proposal::default());
        }
        self.extend_context(last_draft)?;
        let k = k.min(bs - 1);
        let mut ids = vec![self.model.mask_token; bs];
        ids[0] = context[n - 1];
        let mut x = self
            .model
            .embedding
            .forward(&ids, &Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let positions = span(n - 1, bs);
        let (w, ctx_len, width) = (&self.model.weights, self.ctx[0].len, self.kv_width());
        for (layer, cache) in w.layers.iter().zip(self.ctx.iter_mut()) {
            x = layer.forward_rows(&x, &positions, cache, false)?;
            // The block's own keys and values do not stay in the context.
            cache.truncate(ctx_len, width);
        }
        let h = x.len() / bs;
        let eps = w.layers.first().map_or(1e-6, |l| l.shape.rms_norm_eps);
        let normed = rms_rows(&x[h..(k + 1) * h], &w.norm.to_vec1::<f32>()?, eps);
        let logits = self.model.vocab.logits_rows(&normed, k)?;
        let vr = logits.len() / k;
        let mut tokens = Vec::with_capacity(k);
        let mut qs = Vec::with_capacity(k);
        let mut confidence = Vec::with_capacity(k);
        for row in logits.chunks_exact(vr) {
            let Some((t, q, c)) = self.model.vocab.pick_guided(row, &mut self.sampling, &tokens, guide) else {
                break;
            };
            tokens.push(t);
            qs.extend(q);
            confidence.push(c);
        }
        self.last_draft = tokens.len();
        Ok(Proposal {
            tokens,
            q: self.sampling.carries_q().then_some(qs),
            confidence: Some(confidence),
        })
    }

    fn name(&self) -> &'static str {
        "block"
    }

    fn couple(&mut self, key: u64) {
        self.sampling.couple(key);
    }

    fn last_catch_up_s(&self) -> f64 {
        self.catch_up_s
    }

    fn priced_per_pass(&self) -> bool {
        true
    }

    fn taps(&self) -> &[usize] {
        &self.model.taps
    }

    fn observe(&mut self, start: usize, n: usize, hidden: &[&[f32]]) -> Result<()> {
        let th = self.target_h();
        if hidden.len() != self.hidden.len() || hidden.iter().any(|h| h.len() != n * th) {
            bail!("block drafter: expected {} taps of {n} rows of {th}", self.hidden.len());
        }
        let end = self.base + self.n_hidden();
        if self.hidden[0].is_empty() || start > end || start < self.base {
            for h in self.hidden.iter_mut() {
                h.clear();
            }
            self.base = start;
            self.reset_context(0);
        } else if start < end {
            let keep = start - self.base;
            for h in self.hidden.iter_mut() {
                h.truncate(keep * th);
            }
            self.reset_context(start);
        }
        for (dst, src) in self.hidden.iter_mut().zip(hidden) {
            dst.extend_from_slice(src);
        }
        Ok(())
    }
}
