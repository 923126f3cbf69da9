//! Draft-model drafter: a smaller model with the target's tokenizer proposes k tokens by plain
//! autoregressive decoding (Leviathan et al. 2023; Chen et al. 2023).
//!
//! The drafter keeps its own KV cache of the tokens it has seen. Each [`Drafter::propose`] call
//! rolls that cache back to the longest prefix it shares with the committed context (rejected
//! draft tokens go), feeds the committed tokens it has not seen, then decodes k tokens. When
//! more than [`RESEED_GAP`] committed tokens are unseen (the controller paused drafting, or the
//! prompt is long), it re-seeds instead: it drops its cache and feeds only the last
//! [`RESEED_WINDOW`] tokens of the context, at positions from 0; its first proposal feeds the
//! last [`START_WINDOW`] tokens the same way. Catching up a gap costs a draft
//! prefill per token (for the Qwen 0.5B/1.5B pair, ~0.16 of a target step on an AVX-512 CPU
//! before the K-quant tiles, 0.07-0.08 on an AVX2 one after them), so a probe after a long
//! pause would otherwise cost more than the pause saved. Drafts from a
//! windowed context may be worse; exactness does not depend on them (the target verifies). At
//! temperature 0 it proposes its argmax (q one-hot, greedy acceptance); at temperature > 0 it
//! samples from its processed distribution (the request's temperature, top-k, top-p and min-p,
//! no penalties) with its own RNG and returns that distribution as q for rejection sampling.
//! Both add the request's logit bias to its rows first ([`super::DraftSampling`]).

use std::sync::Arc;

use anyhow::{anyhow, Result};

use super::{Drafter, Proposal};
use crate::model::{LogitsRows, Model};
use crate::sampling::SamplingParams;
use crate::target::TargetState;

/// Unseen committed tokens above which the drafter re-seeds from a window instead of catching up.
pub const RESEED_GAP: usize = 96;
/// Tokens of context a re-seed feeds.
pub const RESEED_WINDOW: usize = 64;
/// Tokens of context the first proposal feeds (the end of the prompt and what was committed
/// before the drafter started). On the Qwen pair, with the start deferred until it pays, code
/// ran at 1.40× AR from the last 32 tokens against 1.32× from the whole prompt in one run: the
/// catch-up costs half as much, so the drafter starts sooner, and its drafts are accepted
/// only a little less often (docs/perf.md).
pub const START_WINDOW: usize = 32;
/// Tokens a drafting step feeds when no pause came before it: the last accepted draft (after a
/// full accept) and the target's token. Feeding more is catch-up ([`Drafter::last_catch_up_s`]).
const STEADY_FEED: usize = 2;
/// Longest pause between the controller's probes for a draft model: a probe costs a re-seed
/// (about 10 target steps on the Qwen pair), so probing every [`super::controller::MAX_PAUSE`]
/// steps would cost ~30% of the paused time; every 256 steps costs ~5%.
pub const MAX_PAUSE: usize = 256;

/// Draft vocabulary size used when a ranked list is given without a size: a quarter or less of
/// a 150k vocabulary, which keeps the tokens of nearly every answer (the ranked list covers what
/// the target says; the rest is filled in id order, the tokenizer's merge order).
pub const DRAFT_VOCAB_SIZE: usize = 32_768;

/// The token ids a draft model's reduced LM head covers (FR-Spec, Zhao et al. 2025): the first
/// `n` of `ranked` (token ids by frequency in the target's text, as `specula distill --kind
/// vocab` writes them), then the lowest ids not yet taken until there are `n`, plus the
/// end-of-generation ids `eos`. Ids outside `0..vocab` are skipped. Sorted ascending.
pub fn draft_vocab_ids(ranked: &[u32], n: usize, vocab: usize, eos: &[u32]) -> Vec<u32> {
    let n = n.min(vocab);
    let mut taken = vec![false; vocab];
    let mut ids = Vec::with_capacity(n + eos.len());
    let mut take = |t: u32, ids: &mut Vec<u32>| {
        if let Some(seen) = taken.get_mut(t as usize) {
            if !*seen {
                *seen = true;
                ids.push(t);
            }
        }
    };
    for &t in ranked {
        if ids.len() >= n {
            break;
        }
        take(t, &mut ids);
    }
    let mut next = 0u32;
    while ids.len() < n && (next as usize) < vocab {
        take(next, &mut ids);
        next += 1;
    }
    for &e in eos {
        take(e, &mut ids);
    }
    ids.sort_unstable();
    ids
}

/// The ranked token ids of a draft vocabulary file (`draft_vocab.json` from `specula distill
/// --kind vocab`: an object whose `ranked_ids` is an array of token ids). Errors name the file
/// and the field.
pub fn parse_draft_vocab(text: &str, file: &str) -> Result<Vec<u32>> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| anyhow!("{file}: not a draft vocabulary file (JSON: {e})"))?;
    let arr = v
        .get("ranked_ids")
        .and_then(|a| a.as_array())
        .ok_or_else(|| anyhow!("{file}: field 'ranked_ids' (an array of token ids) is missing"))?;
    arr.iter()
        .enumerate()
        .map(|(i, x)| {
            x.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| anyhow!("{file}: ranked_ids[{i}] is not a token id: {x}"))
        })
        .collect()
}

/// [`START_WINDOW`], or `SPECULA_START_WINDOW=N` (side-by-side measurement only).
fn start_window() -> usize {
    static W: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *W.get_or_init(|| {
        std::env::var("SPECULA_START_WINDOW")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(START_WINDOW)
            .max(1)
    })
}

/// A draft model's per-request state.
pub struct DraftModelDrafter {
    model: Arc<Model>,
    /// The draft model's own target state (its KV rows): cut back to the context it is asked to
    /// continue through [`TargetState::commit`].
    kv: TargetState,
    /// The tokens whose keys and values are in `kv` (`kv.len() == cached.len()`): the context
    /// from position `offset` on.
    cached: Vec<u32>,
    /// Where `cached` starts in the context (0 until the first proposal or a re-seed feeds a
    /// window of it).
    offset: usize,
    /// Seconds the last proposal spent feeding context before drafting.
    catch_up_s: f64,
    /// The request's logit bias, then argmax drafts at temperature 0, sampled ones otherwise.
    sampling: super::DraftSampling,
    prefill_chunk: usize,
}

impl DraftModelDrafter {
    /// A drafter for one request. `params` are the request's sampling parameters: the drafter
    /// drafts greedily when they are greedy, else samples with the same temperature and filters
    /// (penalties off) and an RNG seeded from `seed`.
    pub fn new(model: Arc<Model>, params: &SamplingParams, seed: u64, prefill_chunk: usize) -> Self {
        let sampling = super::DraftSampling::new(params, seed);
        let kv = TargetState::new(model.new_kv_cache());
        Self {
            model,
            kv,
            cached: Vec::new(),
            offset: 0,
            catch_up_s: 0.0,
            sampling,
            prefill_chunk: prefill_chunk.max(1),
        }
    }

    /// Where a proposal continuing `context` starts: the context offset its cache will hold
    /// (the last [`START_WINDOW`] tokens at the first proposal; moved on by a re-seed from the
    /// last [`RESEED_WINDOW`] tokens when more than [`RESEED_GAP`] are unseen) and how many
    /// cached tokens it keeps (the prefix shared with
    /// the context, leaving at least one token to feed: its row gives the first draft's logits).
    fn plan(&self, context: &[u32]) -> (usize, usize) {
        let view = context.get(self.offset..).unwrap_or(&[]);
        let shared = self
            .cached
            .iter()
            .zip(view)
            .take_while(|(a, b)| a == b)
            .count()
            .min(view.len().saturating_sub(1));
        if self.cached.is_empty() && self.offset == 0 {
            return (context.len().saturating_sub(start_window()), 0);
        }
        if self.offset > context.len() || context.len() - self.offset - shared > RESEED_GAP {
            (context.len().saturating_sub(RESEED_WINDOW), 0)
        } else {
            (self.offset, shared)
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
            let out = self.model.forward(c, self.kv.kv_mut(), rows, &[])?;
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
        self.propose_guided(context, k, &mut super::Unguided)
    }

    fn propose_guided(&mut self, context: &[u32], k: usize, guide: &mut dyn super::DraftGuide) -> Result<Proposal> {
        // The first draft token is at sequence position context.len() (coupled draws).
        self.sampling.begin(context.len());
        self.catch_up_s = 0.0;
        if k == 0 || context.is_empty() {
            return Ok(Proposal::default());
        }
        let (offset, shared) = self.plan(context);
        self.offset = offset;
        self.kv.commit(shared);
        self.cached.truncate(shared);
        let view = &context[self.offset..];
        // Never draft past the draft model's own context window.
        let room = self.kv.kv().capacity().saturating_sub(view.len());
        let k = k.min(room);
        if k == 0 {
            return Ok(Proposal::default());
        }
        let started = std::time::Instant::now();
        let mut logits = self.feed(&view[shared..])?;
        // A step that drafts without a pause before it feeds one or two tokens: the target's own
        // token, after the last draft when every draft was accepted (that draft was never fed).
        // Feeding those is part of drafting; only what a pause left unseen is catch-up.
        let fed = view.len() - shared;
        self.catch_up_s = if fed > STEADY_FEED {
            started.elapsed().as_secs_f64() * (fed - STEADY_FEED) as f64 / fed as f64
        } else {
            0.0
        };
        let mut tokens = Vec::with_capacity(k);
        let mut qs = Vec::with_capacity(k);
        let mut confidence = Vec::with_capacity(k);
        for i in 0..k {
            let Some((t, q, c)) = self.sampling.pick_guided(&mut logits, &tokens, guide) else {
                break;
            };
            qs.extend(q);
            tokens.push(t);
            confidence.push(c);
            if i + 1 == k || !guide.go_on(&confidence) {
                break;
            }
            logits = self.feed(&[t])?;
        }
        Ok(Proposal {
            tokens,
            q: self.sampling.carries_q().then_some(qs),
            confidence: Some(confidence),
        })
    }

    fn name(&self) -> &'static str {
        "draft-model"
    }

    fn couple(&mut self, key: u64) {
        self.sampling.couple(key);
    }

    fn last_catch_up_s(&self) -> f64 {
        self.catch_up_s
    }

    fn catch_up_tokens(&self, context: &[u32]) -> usize {
        let (offset, shared) = self.plan(context);
        (context.len().saturating_sub(offset + shared)).saturating_sub(STEADY_FEED)
    }

    fn max_pause(&self) -> Option<usize> {
        Some(MAX_PAUSE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Family;
    use crate::testing::{write_tiny_gguf, TinySpec};

    fn tiny() -> (tempfile::TempDir, Arc<Model>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tiny.gguf");
        write_tiny_gguf(&path, &TinySpec::new(Family::Llama)).expect("write");
        let model = crate::bundle::load(&path, &candle_core::Device::Cpu)
            .expect("load")
            .model;
        (dir, Arc::new(model))
    }

    #[test]
    fn draft_vocab_takes_the_ranked_ids_then_fills_in_id_order() {
        // Ranked: 9, 3, 9 (a repeat), 42 (outside a vocabulary of 12), 7; n = 5, EOS 11.
        let ids = draft_vocab_ids(&[9, 3, 9, 42, 7, 1], 5, 12, &[11]);
        assert_eq!(ids, vec![0, 1, 3, 7, 9, 11]);
        // n past the vocabulary: everything once.
        assert_eq!(draft_vocab_ids(&[2], 50, 4, &[3]), vec![0, 1, 2, 3]);
        // n smaller than the ranked list: its head only.
        assert_eq!(draft_vocab_ids(&[5, 4, 3], 2, 8, &[]), vec![4, 5]);
    }

    #[test]
    fn draft_vocab_files_are_checked() {
        assert_eq!(parse_draft_vocab(r#"{"ranked_ids": [5, 2]}"#, "f").unwrap(), vec![5, 2]);
        let e = parse_draft_vocab(r#"{"ids": []}"#, "dv.json").unwrap_err().to_string();
        assert!(e.contains("dv.json") && e.contains("ranked_ids"), "{e}");
        let e = parse_draft_vocab(r#"{"ranked_ids": [1, -3]}"#, "dv.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("ranked_ids[1]"), "{e}");
        assert!(parse_draft_vocab("not json", "dv.json")
            .unwrap_err()
            .to_string()
            .contains("dv.json"));
    }

    /// The request's logit bias is added to the draft model's rows: a token it favours by 100 is
    /// drafted at every position, greedy or sampled (with q on it); the greedy draft it bans by
    /// -100 is not drafted. (Exactness never depended on it; acceptance does.)
    #[test]
    fn drafts_carry_the_logit_bias() {
        let (_dir, model) = tiny();
        let v = model.config.vocab_size as u32;
        let ctx: Vec<u32> = (0..20u32).map(|i| (i * 5 + 1) % v).collect();
        let draft = |params: &SamplingParams, k: usize| {
            DraftModelDrafter::new(model.clone(), params, 7, 64)
                .propose(&ctx, k)
                .expect("propose")
        };
        let plain = draft(&SamplingParams::greedy(), 4).tokens;
        assert_eq!(plain.len(), 4);
        let fav = (plain[0] + 1) % v;
        let favoured = SamplingParams::greedy()
            .with_logit_bias(vec![(fav, 100.0)])
            .expect("bias");
        assert_eq!(draft(&favoured, 4).tokens, vec![fav; 4]);
        let sampled = SamplingParams {
            temperature: 1.0,
            ..favoured
        };
        let p = draft(&sampled, 4);
        assert_eq!(p.tokens, vec![fav; 4]);
        for q in p.q.expect("a sampled proposal carries q") {
            assert_eq!(q[0].0, fav, "{q:?}");
            assert!(q[0].1 > 0.999, "{q:?}");
        }
        let banned = SamplingParams::greedy()
            .with_logit_bias(vec![(plain[0], -100.0)])
            .expect("bias");
        assert_ne!(draft(&banned, 1).tokens[0], plain[0]);
    }

    #[test]
    fn catch_up_tokens_count_what_a_proposal_feeds_before_drafting() {
        let (_dir, model) = tiny();
        let v = model.config.vocab_size as u32;
        let ctx: Vec<u32> = (0..50u32).map(|i| (i * 7 + 3) % v).collect();
        let mut d = DraftModelDrafter::new(model.clone(), &SamplingParams::greedy(), 0, 64);
        // Before the first draft: the prompt's last START_WINDOW tokens, less a steady step's
        // feed.
        assert_eq!(d.catch_up_tokens(&ctx), start_window() - STEADY_FEED);
        let p = d.propose(&ctx, 3).expect("propose");
        assert_eq!(
            d.cached.len(),
            start_window() + 2,
            "the window and two of the three drafts are fed"
        );
        assert!(d.last_catch_up_s() > 0.0);
        // One draft accepted and the target's token: a steady step, nothing to catch up on.
        let mut next = ctx.clone();
        next.extend([p.tokens[0], (p.tokens[1] + 1) % v]);
        assert_eq!(d.catch_up_tokens(&next), 0);
        let p2 = d.propose(&next, 2).expect("propose");
        assert_eq!(d.last_catch_up_s(), 0.0);
        // Ten committed tokens unseen (a pause; the first is not the fed draft): those, less a
        // steady step's feed.
        let mut paused = next.clone();
        paused.push((p2.tokens[0] + 1) % v);
        paused.extend((0..9u32).map(|i| (i * 5 + 1) % v));
        assert_eq!(d.catch_up_tokens(&paused), 10 - STEADY_FEED);
        // A gap past RESEED_GAP: the re-seed window, less a steady step's feed.
        paused.extend((0..RESEED_GAP as u32).map(|i| (i * 3 + 2) % v));
        assert_eq!(d.catch_up_tokens(&paused), RESEED_WINDOW - STEADY_FEED);
    }

    #[test]
    fn a_long_gap_reseeds_from_a_window_and_a_short_one_catches_up() {
        let (_dir, model) = tiny();
        let v = model.config.vocab_size as u32;
        let ctx: Vec<u32> = (0..200u32).map(|i| (i * 7 + 3) % v).collect();
        let greedy = SamplingParams::greedy();
        let mut d = DraftModelDrafter::new(model.clone(), &greedy, 0, 64);
        // The first proposal feeds the last START_WINDOW tokens (`start_window`).
        let p = d.propose(&ctx, 3).expect("propose");
        assert_eq!(d.offset, ctx.len() - start_window());
        assert_eq!(p.tokens.len(), 3);
        // The same drafts as a drafter given only the window.
        let mut fresh = DraftModelDrafter::new(model.clone(), &greedy, 0, 64);
        let q = fresh.propose(&ctx[ctx.len() - start_window()..], 3).expect("propose");
        assert_eq!(p.tokens, q.tokens);
        assert_eq!(fresh.offset, 0);
        // One draft accepted, then a short gap: caught up in place, no re-seed.
        let mut ctx2 = ctx.clone();
        ctx2.push(p.tokens[0]);
        ctx2.extend((0..10u32).map(|i| (i * 5 + 1) % v));
        let p2 = d.propose(&ctx2, 2).expect("propose");
        assert_eq!(d.offset, ctx.len() - start_window());
        let q2 = fresh.propose(&ctx2[ctx.len() - start_window()..], 2).expect("propose");
        assert_eq!(p2.tokens, q2.tokens);
        // A gap past RESEED_GAP re-seeds again.
        let mut ctx3 = ctx2.clone();
        ctx3.extend((0..(RESEED_GAP as u32 + 5)).map(|i| (i * 3 + 2) % v));
        d.propose(&ctx3, 1).expect("propose");
        assert_eq!(d.offset, ctx3.len() - RESEED_WINDOW);
        assert_eq!(
            d.cached.len(),
            RESEED_WINDOW,
            "the window is fed; the last draft is not"
        );
    }
}
