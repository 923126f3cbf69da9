//! One request's decoding state between target forwards: prefill chunks, then steps of
//! draft → verify → accept → emit. The caller owns the target forward, so a scheduler can run
//! the forwards of many sequences together (their rows are independent: every kernel is
//! batch-invariant, so a sequence's bits do not depend on what it is batched with).
//!
//! Protocol: `next_input()` gives the tokens to feed and which logits rows to return (`None`
//! once finished); the caller runs them through the target with this sequence's KV cache
//! ([`Sequence::kv_mut`]) and hands the rows to `absorb()`, which returns the output that became
//! final. [`crate::Engine::generate`] is this loop for one sequence.

mod draft;
mod verify;

use std::sync::Arc;
use std::time::Instant;

use rand::SeedableRng;
use rand_chacha::ChaCha20Rng;

use crate::constraint::Constraint;
use crate::emit::Emitter;
use crate::kv_cache::KvCache;
use crate::model::{LogitsRows, Model};
use crate::sampling::{self, Sampler};
use crate::speculative::draft_model::DraftModelDrafter;
use crate::speculative::ngram::NgramDrafter;
use crate::speculative::verify::UniformRandomness;
use crate::speculative::{DraftGuide, DraftLength, Drafter, Proposal, SpecMode};
use crate::tokenizer::Tokenizer;
use crate::types::{
    FinishReason, GenerateOutput, GenerateRequest, GenerationStats, StreamDelta, TokenLogprob, TopLogprob,
};

/// What a sequence needs from its engine (shared, read-only).
#[derive(Clone)]
pub struct SequenceEnv {
    pub tokenizer: Tokenizer,
    pub eos_ids: Vec<u32>,
    pub context_length: usize,
    /// Prompt tokens per prefill forward.
    pub prefill_chunk: usize,
    /// Is every target kernel batch-invariant (speculation allowed)?
    pub batch_invariant: bool,
    /// The attached draft model and its id.
    pub draft: Option<(Arc<Model>, String)>,
    /// The draft model's size relative to the target's: the prior of its costs
    /// ([`DraftLength::set_draft_cost_prior`], [`DraftLength::set_catch_up_prior`]).
    pub draft_size: Option<crate::speculative::controller::SizeRatio>,
    /// The target's verify cost by rows before it is measured, `[r - 1]` for r rows
    /// ([`crate::speculative::controller::verify_cost_prior`]).
    pub verify_prior: Vec<f64>,
    /// The attached MTP head.
    pub mtp: Option<Arc<crate::speculative::mtp::MtpHead>>,
    /// The attached block drafter.
    pub block: Option<Arc<crate::speculative::block::BlockDrafterModel>>,
    /// What earlier requests learned about drafting, by decode path (`ngram`,
    /// `draft-model:ID`) and verification (greedy, coupled, rejection; [`prior_key`]): a new request's draft-length
    /// controller starts from it.
    pub controller_priors: std::collections::HashMap<String, DraftLength>,
}

/// The tokens of one target forward for a sequence.
#[derive(Debug, Clone)]
pub struct StepInput {
    pub tokens: Vec<u32>,
    pub rows: LogitsRows,
}

/// What [`Sequence::absorb`] produced.
#[derive(Debug, Default)]
pub struct StepOutcome {
    /// Output that became final (may be empty).
    pub delta: StreamDelta,
    /// The sequence has finished (its output is ready with [`Sequence::finish`]).
    pub finished: bool,
}

use crate::target::{TargetRows, TargetState};
use verify::Verified;

/// One request being decoded.
pub struct Sequence {
    req: GenerateRequest,
    env: SequenceEnv,
    sampler: Sampler,
    emitter: Emitter,
    stats: GenerationStats,
    drafter: Option<Box<dyn Drafter>>,
    /// n-gram lookup beside a model drafter (`on` / `default`): looked up every step, and its
    /// draft verified instead of the model drafter's when it predicts the larger speed-up
    /// ([`Sequence::lookup_draft`]).
    lookup: Option<NgramDrafter>,
    /// The pending draft is the lookup's (its conditional acceptance estimates for the batch's
    /// draft budget), not the model drafter's.
    lookup_alphas: Option<Vec<f64>>,
    /// Rejection sampling's randomness (sampled requests verified by
    /// [`crate::speculative::SampledVerify::Rejection`]).
    accept_rng: Option<UniformRandomness<ChaCha20Rng>>,
    /// Sampled drafts are verified by coupling ([`crate::speculative::SampledVerify::Coupled`]): the target's token
    /// at each row is its keyed draw, as plain decoding draws it.
    coupled: bool,
    /// Structured-output constraint, applied to every row like the penalties.
    constraint: Option<Box<dyn Constraint>>,
    /// The last decode forward's row count and seconds, until its rows are accepted.
    step_forward: Option<(usize, f64)>,
    /// Model drafters' rows are masked with `constraint` ([`StepGuide`]); off only for
    /// side-by-side measurement and tests (`SPECULA_DRAFT_MASK=0`).
    mask_drafts: bool,
    k_ctl: DraftLength,
    /// The model drafter has not started: it must catch up on the prompt first, and starts
    /// when that pays ([`DraftLength::start_pays`]). Meanwhile the request decodes with the
    /// lookup beside it, or plainly.
    deferred: bool,
    /// Output tokens committed by decode steps while `deferred`, and their cost in one-row
    /// target forwards.
    deferred_committed: usize,
    deferred_spent: f64,
    /// The draft model's size against the target's, when the drafter is a draft model (the
    /// prior of its costs until measured).
    draft_size: Option<crate::speculative::controller::SizeRatio>,
    /// Prompt tokens fed by this request's prefill forwards, and those forwards' seconds.
    prefill_fed: usize,
    prefill_forward_s: f64,
    /// Prompt + committed tokens.
    context: Vec<u32>,
    /// The sequence's state in the target (KV rows, or a device slot's committed count).
    state: TargetState,
    max_tokens: usize,
    /// Prompt tokens already fed.
    prefilled: usize,
    /// Where the prompt chunk last handed out by [`Sequence::next_input`] ends (what its
    /// forward's absorb advances `prefilled` to).
    prefill_end: usize,
    /// The draft being verified by the pending forward.
    draft: Proposal,
    /// The input of the next forward, once decoding.
    pending: Option<StepInput>,
    started: Instant,
    decode_started: Option<Instant>,
    /// When the pending forward's input was handed out (for the controller's timings).
    forward_started: Option<Instant>,
    /// The drafter's taps from the last verify forward: its first position and one
    /// `[fed, hidden]` buffer per tap (the committed rows go to the drafter after acceptance).
    tapped: Option<(usize, Vec<Vec<f32>>)>,
}

impl Sequence {
    /// A sequence for a validated request (see [`crate::Engine::validate`]), with an empty KV
    /// cache `kv` (the caller may pre-fill it with a cached prefix: [`Sequence::skip_prefix`]).
    pub fn new(env: SequenceEnv, req: GenerateRequest, kv: KvCache) -> Self {
        Self::with_constraint(env, req, kv, None)
    }

    /// As [`Sequence::new`], with every logits row masked by `constraint` (structured output).
    pub fn with_constraint(
        env: SequenceEnv,
        req: GenerateRequest,
        kv: KvCache,
        constraint: Option<Box<dyn Constraint>>,
    ) -> Self {
        let ctx = env.context_length;
        let room = ctx.saturating_sub(req.prompt_tokens.len());
        let max_tokens = req.max_tokens.unwrap_or(room).min(room);
        let mut sampler = Sampler::new(req.sampling.clone());
        let emitter = Emitter::new(
            &env.tokenizer,
            &env.eos_ids,
            req.stop.clone(),
            req.ignore_eos,
            max_tokens,
        );
        let mut stats = GenerationStats {
            prompt_tokens: req.prompt_tokens.len(),
            ..Default::default()
        };
        // Speculation is used only where it is exact (see `spec`); otherwise plain AR, and the
        // stats say why.
        let mut drafter: Option<Box<dyn Drafter>> = None;
        let mut draft_size = None;
        // A sampling drafter's RNG seed, forked from the request's stream (greedy: unused).
        let greedy = req.sampling.is_greedy();
        let draft_seed = |s: &mut Sampler| if greedy { 0 } else { s.fork_seed() };
        let resolved = resolve(
            req.spec.mode,
            env.draft.is_some(),
            env.mtp.is_some(),
            env.block.is_some(),
        );
        stats.spec.decode_path = match (resolved, &env.draft) {
            (None, _) => "ar".into(),
            (Some(_), _) if !env.batch_invariant => {
                "ar (this model's kernels are not batch-invariant: K-quant or f32 weights)".into()
            }
            (Some(SpecMode::Draft), Some((model, id))) => {
                let seed = draft_seed(&mut sampler);
                draft_size = env.draft_size;
                drafter = Some(Box::new(DraftModelDrafter::new(
                    model.clone(),
                    &req.sampling,
                    seed,
                    env.prefill_chunk,
                )));
                format!("draft-model:{id}")
            }
            (Some(SpecMode::Draft), None) => "ar (no draft model attached)".into(),
            (Some(SpecMode::Mtp), _) => match &env.mtp {
                Some(head) => {
                    let seed = draft_seed(&mut sampler);
                    drafter = Some(Box::new(crate::speculative::mtp::MtpDrafter::new(
                        head.clone(),
                        &req.sampling,
                        seed,
                    )));
                    "mtp".into()
                }
                None => "ar (no MTP head attached)".into(),
            },
            (Some(SpecMode::Block), _) => match &env.block {
                Some(m) => {
                    let seed = draft_seed(&mut sampler);
                    drafter = Some(Box::new(crate::speculative::block::BlockDrafter::new(
                        m.clone(),
                        &req.sampling,
                        seed,
                    )));
                    "block".into()
                }
                None => "ar (no block drafter attached)".into(),
            },
            (Some(_), _) => {
                drafter = Some(Box::new(ngram_drafter(&env)));
                "ngram".into()
            }
        };
        // `on` / `default` with a model drafter: n-gram lookup beside it, for the steps where
        // the context repeats itself (a copied document, a list) and a free draft of several
        // tokens beats the model's. `ngram` and the named model drafters stay alone.
        let lookup = (lookup_beside(&req.spec, resolved) && drafter.is_some()).then(|| ngram_drafter(&env));
        if lookup.is_some() {
            stats.spec.decode_path.push_str("+ngram");
        }
        // A sampled request verifies by coupling (a seed's output is plain decoding's, whatever
        // the drafts; the default) or by rejection sampling, whose acceptance draws from its
        // own stream, derived from the request seed.
        let coupled = drafter.is_some() && !greedy && req.spec.sampled_verify.coupled();
        if coupled {
            if let Some(d) = drafter.as_mut() {
                d.couple(sampler.noise_key());
            }
        }
        let accept_rng = (drafter.is_some() && !greedy && !coupled)
            .then(|| UniformRandomness(ChaCha20Rng::seed_from_u64(sampler.fork_seed())));
        if drafter.is_some() {
            stats.spec.verify = match (greedy, coupled) {
                (true, _) => "greedy",
                (false, true) => "coupled",
                (false, false) => "rejection",
            };
        }
        let mut k_ctl = DraftLength::new(req.spec.draft_max, req.spec.adaptive);
        k_ctl.set_verify_prior(env.verify_prior.clone());
        if let Some(p) = drafter.as_ref().and_then(|d| d.max_pause()) {
            k_ctl.set_max_pause(p);
        }
        if drafter.as_ref().is_some_and(|d| d.priced_per_pass()) {
            k_ctl.set_priced_per_pass();
        }
        if let Some(prior) = env
            .controller_priors
            .get(&prior_key(&stats.spec.decode_path, stats.spec.verify))
        {
            k_ctl.warm_start(prior);
        }
        // `SPECULA_DEFER_START=0` starts a draft model at once (side-by-side measurement only).
        let deferred = k_ctl.adaptive()
            && std::env::var("SPECULA_DEFER_START").map_or(true, |v| v != "0")
            && drafter
                .as_ref()
                .is_some_and(|d| d.catch_up_tokens(&req.prompt_tokens) > 0);
        if let (true, Some(size)) = (k_ctl.adaptive(), draft_size) {
            k_ctl.set_draft_cost_prior(size.step);
        }
        let context = req.prompt_tokens.clone();
        Self {
            req,
            env,
            sampler,
            emitter,
            stats,
            drafter,
            lookup,
            lookup_alphas: None,
            accept_rng,
            coupled,
            constraint,
            k_ctl,
            deferred,
            mask_drafts: std::env::var("SPECULA_DRAFT_MASK").map_or(true, |v| v != "0"),
            step_forward: None,
            deferred_committed: 0,
            deferred_spent: 0.0,
            draft_size,
            prefill_fed: 0,
            prefill_forward_s: 0.0,
            context,
            state: TargetState::new(kv),
            max_tokens,
            prefilled: 0,
            prefill_end: 0,
            draft: Proposal::default(),
            pending: None,
            started: Instant::now(),
            decode_started: None,
            forward_started: None,
            tapped: None,
        }
    }

    /// Give this sequence a device KV slot ([`crate::Engine::attach_device`]).
    pub fn set_device_slot(&mut self, lease: crate::device::SlotLease) {
        self.state.set_slot(lease);
    }

    /// The device KV slot this sequence holds, if any.
    pub fn device_slot(&self) -> Option<u32> {
        self.state.slot()
    }

    /// The target hidden states this sequence's drafter reads ([`Drafter::taps`]); the caller
    /// returns them with the logits rows ([`Sequence::absorb_with_hidden`]).
    pub fn taps(&self) -> &[usize] {
        match &self.drafter {
            Some(d) => d.taps(),
            None => &[],
        }
    }

    /// The state the next forward must use ([`crate::target::Target::forward`]).
    pub fn target_state(&mut self) -> &mut TargetState {
        &mut self.state
    }

    /// The KV cache (the prefix cache reads and fills it).
    pub fn kv_mut(&mut self) -> &mut KvCache {
        self.state.kv_mut()
    }

    pub fn kv(&self) -> &KvCache {
        self.state.kv()
    }

    /// The request.
    pub fn request(&self) -> &GenerateRequest {
        &self.req
    }

    /// Still prefilling the prompt?
    pub fn is_prefilling(&self) -> bool {
        self.decode_started.is_none()
    }

    /// Prompt tokens not fed yet (0 once decoding).
    pub fn prefill_remaining(&self) -> usize {
        if self.is_prefilling() {
            self.req.prompt_tokens.len().saturating_sub(self.prefilled)
        } else {
            0
        }
    }

    /// Prompt tokens taken from the prefix cache ([`Sequence::skip_prefix`]).
    pub fn cached_prompt_tokens(&self) -> usize {
        self.stats.cached_prompt_tokens
    }

    /// Mark the first `n` prompt tokens as already in the KV cache (a prefix-cache hit). At least
    /// one prompt token is always left to feed, since its logits give the first output token.
    pub fn skip_prefix(&mut self, n: usize) {
        let n = n.min(self.req.prompt_tokens.len().saturating_sub(1));
        self.state.commit(n);
        self.prefilled = n;
        self.prefill_end = n;
        self.stats.cached_prompt_tokens = n;
    }

    /// The draft-length controller (what this request learned about drafting), with the key
    /// the next requests look it up by ([`prior_key`]); `None` when the request did not
    /// speculate.
    pub fn controller(&self) -> Option<(String, &DraftLength)> {
        self.drafter.as_ref().map(|_| {
            (
                prior_key(&self.stats.spec.decode_path, self.stats.spec.verify),
                &self.k_ctl,
            )
        })
    }

    /// Has generation finished?
    pub fn finished(&self) -> Option<FinishReason> {
        self.emitter.finished()
    }

    /// The next forward's input, or `None` when finished.
    pub fn next_input(&mut self) -> Option<StepInput> {
        self.next_input_capped(usize::MAX)
    }

    /// As [`Sequence::next_input`], with a prompt chunk of at most `max_rows` rows (at least
    /// one): the batch's prompt-row budget gives a long prompt what a shorter one left. Where a
    /// chunk ends does not change a bit of the result (every row's forward is the same
    /// whatever the rows beside it: the batch-invariant kernels).
    pub fn next_input_capped(&mut self, max_rows: usize) -> Option<StepInput> {
        if self.emitter.finished().is_some() {
            return None;
        }
        self.forward_started = Some(Instant::now());
        if self.decode_started.is_none() {
            let prompt = &self.req.prompt_tokens;
            let chunk = self.env.prefill_chunk.min(max_rows).max(1);
            let end = (self.prefilled + chunk).min(prompt.len());
            self.prefill_end = end;
            let rows = if end == prompt.len() {
                LogitsRows::Last
            } else {
                LogitsRows::None
            };
            return Some(StepInput {
                tokens: prompt[self.prefilled..end].to_vec(),
                rows,
            });
        }
        self.pending.clone()
    }

    /// The draft the pending forward would verify, as the batch's draft budget weighs it
    /// ([`crate::speculative::controller::draft_budget`]); `None` while prefilling, once finished, or
    /// without a draft.
    pub fn pending_draft(&self) -> Option<crate::speculative::controller::PendingDraft> {
        if self.is_prefilling() || self.emitter.finished().is_some() || self.draft.is_empty() {
            return None;
        }
        // A sampled draft verified by rejection sampling (one with q; coupled drafts have none
        // and are deterministic) is never kept or dropped by its own confidence
        // (`DraftLength::verified_prefix`), nor trimmed by the batch's budget: the budget's
        // choice of a prefix depends on the draft's whole length, which depends on the tokens
        // drawn (the controller's `go_on`, a mask that leaves nothing), so whether a drawn
        // token is verified could depend on that token itself, which rejection sampling does
        // not allow.
        let alphas = match (&self.lookup_alphas, &self.draft.confidence) {
            (Some(a), _) => a.clone(),
            (None, Some(c)) if self.k_ctl.confidence_driven() && self.draft.q.is_none() => self.k_ctl.calibrated(c),
            _ => self.k_ctl.alphas(self.draft.len()),
        };
        Some(crate::speculative::controller::PendingDraft {
            len: self.draft.len(),
            alphas,
            trimmable: self.k_ctl.adaptive() && self.draft.q.is_none(),
        })
    }

    /// Verify only the first `keep` tokens of the pending draft (the rest count as trimmed in
    /// the stats). Exactness does not depend on it: the target decides every committed token
    /// whatever the draft's length, and a drafter with state rolls back to the committed
    /// context at its next proposal. Call before [`Sequence::next_input`].
    pub fn trim_draft(&mut self, keep: usize) {
        let Some(pending) = self.pending.as_mut() else {
            return;
        };
        if keep >= self.draft.len() {
            return;
        }
        self.stats.spec.trimmed += self.draft.len() - keep;
        self.draft.truncate(keep);
        pending.tokens.truncate(1 + keep);
        if let Some(a) = self.lookup_alphas.as_mut() {
            a.truncate(keep);
        }
        if keep == 0 {
            pending.rows = LogitsRows::Last;
            if self.lookup_alphas.is_none() {
                // The model drafter's cost was paid for nothing (the lookup's costs nothing).
                self.k_ctl.note_trimmed();
            }
        }
    }

    /// Cancel: the sequence finishes with reason `cancelled`.
    pub fn cancel(&mut self) -> StreamDelta {
        self.emitter.finish_with(FinishReason::Cancelled)
    }

    /// Tell the draft-length controller what drafting costs in the batch this sequence shares
    /// (None when it runs alone); see [`crate::speculative::controller::BatchCost`].
    pub fn set_load(&mut self, load: Option<crate::speculative::controller::Load>) {
        self.k_ctl.set_load(load);
    }

    /// Take the rows of the forward run on [`Sequence::next_input`]'s tokens (one per fed token
    /// for a verify, one for a decode step or a prompt's last chunk, none for other chunks), and
    /// advance: accept, emit, and prepare the next input (drafting happens here).
    ///
    /// Errors: a drafter failure (the sequence cannot continue).
    pub fn absorb(&mut self, rows: Vec<Vec<f32>>) -> anyhow::Result<StepOutcome> {
        self.absorb_with_hidden(rows, Vec::new())
    }

    /// As [`Sequence::absorb`], with the forward's hidden states at [`Sequence::taps`]: one
    /// row-major `[fed tokens, hidden]` f32 buffer per tap, in that order (empty when the
    /// sequence has no taps). The committed rows go to the drafter ([`Drafter::observe`]).
    pub fn absorb_with_hidden(&mut self, rows: Vec<Vec<f32>>, hidden: Vec<Vec<f32>>) -> anyhow::Result<StepOutcome> {
        self.absorb_rows(TargetRows::Logits(rows), hidden)
    }

    /// Whether this sequence's next acceptance needs only each row's argmax (lowest id on a
    /// tie): greedy, no logit bias or penalties, no logprobs, no constraint. A device target
    /// then returns the argmax it computed instead of the logits ([`Sequence::absorb_argmax`]).
    pub fn argmax_suffices(&self) -> bool {
        self.req.sampling.is_greedy()
            && !self.req.sampling.transforms_logits()
            && self.req.logprobs.is_none()
            && self.constraint.is_none()
            && self.taps().is_empty()
    }

    /// As [`Sequence::absorb`], with each logits row replaced by its argmax (lowest id on a
    /// tie, the rule of [`crate::sampling::argmax`]). Errors when
    /// [`Sequence::argmax_suffices`] is false.
    pub fn absorb_argmax(&mut self, argmax: Vec<u32>) -> anyhow::Result<StepOutcome> {
        if !self.argmax_suffices() {
            anyhow::bail!("this request needs the logits rows, not only their argmax");
        }
        self.absorb_rows(TargetRows::Argmax(argmax), Vec::new())
    }

    /// As [`Sequence::absorb_with_hidden`] or [`Sequence::absorb_argmax`], by what the target
    /// returned ([`crate::target::Target::forward`]).
    pub fn absorb_target(&mut self, rows: TargetRows, hidden: Vec<Vec<f32>>) -> anyhow::Result<StepOutcome> {
        match rows {
            TargetRows::Argmax(a) => self.absorb_argmax(a),
            TargetRows::Logits(l) => self.absorb_with_hidden(l, hidden),
        }
    }

    fn absorb_rows(&mut self, mut rows: TargetRows, hidden: Vec<Vec<f32>>) -> anyhow::Result<StepOutcome> {
        let secs = self.forward_started.take().map_or(0.0, |t| t.elapsed().as_secs_f64());
        let has_taps = !hidden.is_empty() && !self.taps().is_empty();
        if self.decode_started.is_none() {
            let prompt_len = self.req.prompt_tokens.len();
            let end = self.prefill_end.max(self.prefilled);
            if has_taps {
                // Every prompt row is committed.
                let (start, n) = (self.prefilled, end - self.prefilled);
                let views: Vec<&[f32]> = hidden.iter().map(Vec::as_slice).collect();
                if let Some(d) = self.drafter.as_mut() {
                    d.observe(start, n, &views)?;
                }
            }
            self.prefill_fed += end - self.prefilled;
            self.prefill_forward_s += secs;
            self.prefilled = end;
            if end < prompt_len {
                return Ok(StepOutcome::default());
            }
            self.stats.prefill_s = self.started.elapsed().as_secs_f64();
            self.decode_started = Some(Instant::now());
            if let (true, Some(size)) = (self.deferred, self.draft_size) {
                // The draft model's catch-up runs its blocks over context tokens as the
                // target's prefill forwards just did over the prompt (their own seconds, not
                // the batch's other work between them). Too few tokens (a prefix-cache hit)
                // say little: then no prior, and the drafter starts as it did before
                // catch-ups were priced (a measured cost carried from an earlier request
                // still counts).
                if self.prefill_fed >= crate::speculative::controller::MIN_CATCH_UP_SAMPLE {
                    let per_token = self.prefill_forward_s / self.prefill_fed as f64;
                    self.k_ctl.set_catch_up_prior(size.blocks * per_token);
                }
            }
        } else {
            self.stats.decode_steps += 1;
            let fed = 1 + self.draft.len();
            self.stats.spec.record_forward(fed, secs);
            // The controller prices the step as the forward plus its rows' acceptance
            // (sampling, masks, the emit): observed once they are done.
            self.step_forward = Some((fed, secs));
            if has_taps {
                self.tapped = Some((self.state.len().saturating_sub(fed), hidden));
            }
        }
        if rows.is_empty() {
            anyhow::bail!("the forward returned no logits rows");
        }
        if rows.len() != self.draft.len() + 1 {
            anyhow::bail!(
                "the forward returned {} logits rows for a draft of {}",
                rows.len(),
                self.draft.len()
            );
        }
        let outcome = self.accept_and_emit(&mut rows)?;
        if outcome.finished {
            self.close_stats();
        }
        Ok(outcome)
    }

    /// One verify step's acceptance: verify ([`Sequence::verify`]), emit
    /// ([`Sequence::emit_verified`]), roll back ([`Sequence::commit_verified`]), and draft the
    /// next block ([`Sequence::draft_next`]).
    fn accept_and_emit(&mut self, rows: &mut TargetRows) -> anyhow::Result<StepOutcome> {
        let accept_started = Instant::now();
        let draft = std::mem::take(&mut self.draft);
        let v = self.verify(rows, &draft)?;
        let (accepted, next) = (v.accepted, v.next);
        let (out, block) = self.emit_verified(&draft, v, accept_started);
        let delta = out.delta;
        if out.finished.is_some() {
            return Ok(StepOutcome { delta, finished: true });
        }
        self.commit_verified(&draft, accepted, &block)?;
        self.draft_next(next, delta)
    }

    /// Emit the verified block (the accepted drafts and the next token) through the emit step,
    /// one token at a time, and record what the step taught the controller and the stats.
    /// Returns the emitter's result and the block.
    fn emit_verified(
        &mut self,
        draft: &Proposal,
        v: Verified,
        accept_started: Instant,
    ) -> (crate::emit::EmitOutcome, Vec<u32>) {
        let Verified { accepted, next, lps } = v;
        let from_lookup = self.lookup_alphas.take().is_some();
        if !draft.is_empty() && !from_lookup {
            // The lookup learns its own outcome at its next proposal; the controller's
            // estimates are the model drafter's, from what the target agreed with (drafts
            // past a stop point included).
            self.k_ctl.update(draft.len(), accepted);
            if let Some(c) = &draft.confidence {
                self.k_ctl.observe_confidence(c, accepted);
            }
        }
        let mut block = draft.tokens[..accepted].to_vec();
        block.push(next);
        let block_lps = lps.map(|l| {
            block
                .iter()
                .zip(l)
                .map(|(&id, (all, top))| TokenLogprob {
                    id,
                    token: self.env.tokenizer.token_text(id),
                    logprob: all[id as usize],
                    top,
                })
                .collect::<Vec<_>>()
        });
        let out = self.emitter.emit_block(&block, block_lps.as_deref());
        if let Some((fed, secs)) = self.step_forward.take() {
            // A row's processing (the logit bias, penalties, the grammar's mask, the
            // distribution, rejection sampling) grows with the rows as the forward does; priced
            // apart from it, drafts that barely pay by the forward alone lose.
            self.k_ctl
                .observe_forward(fed, secs + accept_started.elapsed().as_secs_f64());
        }
        if !draft.is_empty() {
            // The stats count as accepted only the drafts that reached the output: a block cut
            // at EOS, a stop string or max_tokens drops the accepted drafts after the cut.
            let in_output = accepted.min(out.committed);
            self.stats.spec.record(draft.len(), in_output);
            if from_lookup {
                self.stats.spec.lookup_drafted += draft.len();
                self.stats.spec.lookup_accepted += in_output;
            }
        }
        if self.stats.decode_steps > 0 {
            // Tokens committed by target decode steps (the first token came from prefill).
            self.stats.spec.committed += out.committed;
            if self.deferred {
                self.deferred_committed += out.committed;
                self.deferred_spent += self.k_ctl.relative_forward_cost(draft.len() + 1);
            }
        }
        (out, block)
    }

    /// Roll the target state back to the committed length (the pending token before the draft
    /// plus the accepted drafts; `next` is not in it yet), extend the context by `block`, and
    /// hand the committed rows' hidden states to the drafter.
    fn commit_verified(&mut self, draft: &Proposal, accepted: usize, block: &[u32]) -> anyhow::Result<()> {
        // Keep the committed part of the verified block in the KV cache: the pending token
        // before the draft plus the accepted drafts (`next` is not in the cache yet).
        let keep = self.state.len() - draft.len() + accepted;
        self.state.commit(keep);
        self.context.extend_from_slice(block);
        if let (Some((start, hidden)), Some(d)) = (self.tapped.take(), self.drafter.as_mut()) {
            // The fed token and the accepted drafts are committed; their rows go to the drafter.
            let n = accepted + 1;
            let views: Vec<&[f32]> = hidden.iter().map(|h| &h[..(h.len() / (draft.len() + 1)) * n]).collect();
            d.observe(start, n, &views)?;
        }
        Ok(())
    }

    fn close_stats(&mut self) {
        self.stats.spec.target_steps = self.stats.decode_steps;
        if let Some(t) = self.decode_started {
            self.stats.decode_s = t.elapsed().as_secs_f64();
        } else {
            self.stats.prefill_s = self.started.elapsed().as_secs_f64();
        }
        self.stats.completion_tokens = self.emitter.tokens().len();
    }

    /// The request's output (call once finished, or to end it early with what it has), and the
    /// KV cache (for reuse by the next request or a prefix cache).
    pub fn finish(mut self) -> (GenerateOutput, KvCache) {
        self.close_stats();
        if let Some(d) = &self.drafter {
            tracing::debug!(
                drafter = d.name(),
                drafted = self.stats.spec.drafted,
                accepted = self.stats.spec.accepted,
                tau = self.stats.spec.tau(),
                "speculation"
            );
        }
        let finish_reason = self.emitter.finished().unwrap_or(FinishReason::Length);
        let out = GenerateOutput {
            text: self.emitter.text().to_string(),
            token_ids: self.emitter.tokens().to_vec(),
            logprobs: self.req.logprobs.map(|_| self.emitter.logprobs().to_vec()),
            finish_reason,
            stop_sequence: self.emitter.matched_stop().map(str::to_string),
            stats: self.stats,
        };
        (out, self.state.into_kv())
    }
}

/// The key under which a request's draft-length controller is kept for the requests after it
/// ([`SequenceEnv::controller_priors`]): its decode path, and how it verifies
/// ([`crate::speculative::SpecStats::verify`]: greedy, coupled or rejection). A greedy draft is accepted
/// only when it is the argmax, a sampled one when it is the target's draw (coupled) or with
/// probability min(1, p/q) (rejection), so their acceptance differs (SmolLM2's MTP head on JSON:
/// 0.84-0.94 greedy, 0.40 at temperature 1) and no kind of request starts from another's record.
fn prior_key(decode_path: &str, verify: &str) -> String {
    format!("{decode_path} ({verify})")
}

/// Whether a request with speculation settings `spec` whose drafter resolved to `resolved`
/// ([`resolve`]) runs n-gram lookup beside it: `on` and `default` with a model drafter (draft
/// model, MTP head, block drafter) and adaptive k (a fixed k drafts k tokens with the model
/// drafter every step, as `--fixed-k` promises). Its decode path then ends in `+ngram`.
pub fn lookup_beside(spec: &crate::speculative::SpecOptions, resolved: Option<SpecMode>) -> bool {
    spec.adaptive
        && matches!(spec.mode, SpecMode::On | SpecMode::Default)
        && matches!(resolved, Some(SpecMode::Draft | SpecMode::Mtp | SpecMode::Block))
}

/// The n-gram drafter of a sequence, with the tokenizer's number tokens. For side-by-side
/// measurement: `SPECULA_NGRAM_WRAP=0` (one lookup per draft), `SPECULA_NGRAM_MIN_N=N` (the
/// shortest match), `SPECULA_NGRAM_CONFIDENCE=C` (the confidence cut; 0: none).
fn ngram_drafter(env: &SequenceEnv) -> NgramDrafter {
    let base = NgramDrafter::default();
    let wrap = std::env::var("SPECULA_NGRAM_WRAP").map_or(true, |v| v != "0");
    let min_n = std::env::var("SPECULA_NGRAM_MIN_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(base.min_n);
    let min_confidence = std::env::var("SPECULA_NGRAM_CONFIDENCE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(base.min_confidence);
    NgramDrafter {
        wrap,
        min_n,
        min_confidence,
        ..base
    }
    .with_numbers(env.tokenizer.numbers())
}

/// The drafter a speculative mode resolves to: `None` for AR. `Default` / `On` take the best
/// drafter attached: an MTP head, else a block drafter, else a draft model, else n-gram lookup
/// (the order `specula inspect` reports).
pub fn resolve(mode: SpecMode, has_draft_model: bool, has_mtp: bool, has_block: bool) -> Option<SpecMode> {
    match mode {
        SpecMode::Off => None,
        SpecMode::Default | SpecMode::On => Some(if has_mtp {
            SpecMode::Mtp
        } else if has_block {
            SpecMode::Block
        } else if has_draft_model {
            SpecMode::Draft
        } else {
            SpecMode::Ngram
        }),
        m => Some(m),
    }
}

/// Raw log-softmax of a logits row and its `n` best entries.
fn token_logprobs(tokenizer: &Tokenizer, logits: &[f32], n: usize) -> (Vec<f32>, Vec<TopLogprob>) {
    let all = sampling::log_softmax(logits);
    let top = sampling::top_n(&all, n)
        .into_iter()
        .map(|(id, logprob)| TopLogprob {
            id,
            token: tokenizer.token_text(id),
            logprob,
        })
        .collect();
    (all, top)
}
