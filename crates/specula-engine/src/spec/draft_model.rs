//! Draft-model drafter: a smaller model with the target's tokenizer proposes k tokens by plain
//! autoregressive decoding (Leviathan et al. 2023; Chen et al. 2023).
//!
//! The drafter keeps its own KV cache of the tokens it has seen. Each [`Drafter::propose`] call
//! rolls that cache back to the longest prefix it shares with the committed context (rejected
//! draft tokens go), feeds the committed tokens it has not seen, then decodes k tokens. At
//! temperature 0 it proposes its argmax (q one-hot, greedy acceptance); at temperature > 0 it
//! samples from its processed distribution (the request's temperature, top-k, top-p and min-p,
//! no penalties) with its own RNG and returns that distribution as q for rejection sampling.

use std::sync::Arc;

use anyhow::{anyhow, Result};

use super::{Drafter, Proposal};
use crate::kv_cache::KvCache;
use crate::model::{LogitsRows, Model};
use crate::sampling::{argmax, Sampler, SamplingParams};

/// A draft model's per-request state.
pub struct DraftModelDrafter {
    model: Arc<Model>,
    kv: KvCache,
    /// The tokens whose keys and values are in `kv` (`kv.len() == cached.len()`).
    cached: Vec<u32>,
    /// `None` at temperature 0 (argmax drafts); else the sampler drafts are drawn with.
    sampler: Option<Sampler>,
    prefill_chunk: usize,
}

impl DraftModelDrafter {
    /// A drafter for one request. `params` are the request's sampling parameters: the drafter
    /// drafts greedily when they are greedy, else samples with the same temperature and filters
    /// (penalties off) and an RNG seeded from `seed`.
    pub fn new(model: Arc<Model>, params: &SamplingParams, seed: u64, prefill_chunk: usize) -> Self {
        let sampler = crate::sampling::draft_sampler(params, seed);
        let kv = model.new_kv_cache();
        Self {
            model,
            kv,
            cached: Vec::new(),
            sampler,
            prefill_chunk: prefill_chunk.max(1),
        }
    }

    /// Feed `tokens` after the cache; returns the last row's logits.
    fn feed(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let n_chunks = tokens.len().div_ceil(self.prefill_chunk);
        let mut last = None;
        for (i, c) in tokens.chunks(self.prefill_chunk).enumerate() {
            let rows = if i + 1 == n_chunks {
                LogitsRows::Last
            } else {
                LogitsRows::None
            };
            let out = self.model.forward(c, &mut self.kv, rows, &[])?;
            self.cached.extend_from_slice(c);
            if i + 1 == n_chunks {
                last = Some(out.logits.squeeze(0)?.to_vec1::<f32>()?);
            }
        }
        last.ok_or_else(|| anyhow!("draft model: nothing to feed"))
    }
}

impl Drafter for DraftModelDrafter {
    fn propose(&mut self, context: &[u32], k: usize) -> Result<Proposal> {
        if k == 0 || context.is_empty() {
            return Ok(Proposal::default());
        }
        // Roll back to the shared prefix, keeping at least one token to feed (its row gives the
        // logits for the first draft).
        let shared = self
            .cached
            .iter()
            .zip(context)
            .take_while(|(a, b)| a == b)
            .count()
            .min(context.len() - 1);
        self.kv.truncate(shared);
        self.cached.truncate(shared);
        // Never draft past the draft model's own context window.
        let room = self.kv.capacity().saturating_sub(context.len());
        let k = k.min(room);
        if k == 0 {
            return Ok(Proposal::default());
        }
        let mut logits = self.feed(&context[shared..])?;
        let mut tokens = Vec::with_capacity(k);
        let mut qs = Vec::with_capacity(k);
        for i in 0..k {
            let t = match self.sampler.as_mut() {
                None => argmax(&logits),
                Some(s) => {
                    let dist = s.distribution(&logits);
                    let t = s.draw(&dist);
                    qs.push(dist);
                    t
                }
            };
            tokens.push(t);
            if i + 1 < k {
                logits = self.feed(&[t])?;
            }
        }
        Ok(Proposal {
            tokens,
            q: self.sampler.is_some().then_some(qs),
        })
    }

    fn name(&self) -> &'static str {
        "draft-model"
    }
}
