//! Speculative decoding: drafters propose tokens, the target verifies them in one forward pass,
//! and only what plain decoding would have produced is committed.
//!
//! This first cut covers greedy requests with deterministic drafters (n-gram prompt lookup):
//! the drafter's distribution q is one-hot, so acceptance is the greedy rule of
//! [`verify::accept_greedy`]. Exactness rests on the target's verify rows being bitwise equal to
//! one-row decode rows ([`crate::model::Model::batch_invariant`]); a model whose kernels are not
//! invariant decodes plain AR and says so in its stats.

pub mod block;
pub mod controller;
pub mod draft_model;
pub mod head;
pub mod mtp;
pub mod ngram;
pub mod verify;

use serde::{Deserialize, Serialize};

pub use controller::DraftLength;

/// Which drafter a request uses.
///
/// `default` and `on` pick the best drafter the engine has: the attached MTP head, else the
/// attached block drafter, else the attached draft model, else n-gram lookup. `default` will later follow a measured tuning file (it may choose AR); `on` always
/// speculates where it is exact, with the adaptive controller deciding k per step. `ngram` and
/// `draft`, `mtp` and `block` name a drafter explicitly (one that is not attached is a request
/// error).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SpecMode {
    /// Plain autoregressive decoding.
    #[default]
    Off,
    /// The bundle's default drafter (draft model if attached, else n-gram lookup).
    Default,
    /// Speculate with the best drafter available.
    On,
    /// n-gram prompt lookup (no model, no cost).
    Ngram,
    /// The attached draft model.
    Draft,
    /// The attached MTP head ([`mtp`]).
    Mtp,
    /// The attached block drafter ([`block`]).
    Block,
}

impl SpecMode {
    /// Parse `off|default|on|ngram|draft`.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "off" => Self::Off,
            "default" => Self::Default,
            "on" => Self::On,
            "ngram" => Self::Ngram,
            "draft" => Self::Draft,
            "mtp" => Self::Mtp,
            "block" => Self::Block,
            _ => return None,
        })
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::Default => "default",
            Self::On => "on",
            Self::Ngram => "ngram",
            Self::Draft => "draft",
            Self::Mtp => "mtp",
            Self::Block => "block",
        }
    }
}

/// How a sampled request (temperature > 0) verifies drafts.
///
/// Both commit tokens distributed exactly as plain sampling from the target's processed
/// distribution p. They differ in what a seed fixes and in acceptance:
/// - `Coupled` (the default): drafter-invariant sampling (Daliri, Musco, Suresh 2024, "Coupling without
///   Communication and Drafter-Invariant Speculative Decoding"). The target's token at each
///   position is [`crate::sampling::keyed_draw`] of its row: a function of the seed, the
///   position and p alone, as plain sampling draws it. Drafts are verified as greedy ones are
///   (the longest prefix equal to the target's tokens, then the target's own token), so a
///   seeded request's output is byte-identical to plain decoding with that seed, whatever the
///   drafter, k, batch or timing. Model drafters draw their tokens with the same key and
///   agree with the target with probability at least (1 − TV)/(1 + TV); a deterministic
///   drafter (n-gram lookup) is accepted with probability p(d), as under rejection. Coupled
///   drafts are deterministic, so the controller's confidence cut, the grammar cut and the
///   batch's draft budget apply to them as to greedy drafts; measured through the server at
///   temperature 1 (docs/perf.md) that made coupling as fast as rejection on
///   SmolLM2 with its MTP head and 4-10% faster on the Qwen pair.
/// - `Rejection`: speculative sampling (Leviathan et al. 2023, Chen et al. 2023;
///   [`verify::accept_sampled`]): accept a draft d drawn from q with probability
///   min(1, p(d)/q(d)), else draw from norm(max(0, p − q)). The most accepted drafts any
///   verification can give a token (1 − TV(p, q)), but a seeded request's output depends on
///   what was drafted (draft lengths chosen from measured timings, the batch's draft budget),
///   and a sampled draft may not be cut or trimmed by what was drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SampledVerify {
    #[default]
    Coupled,
    Rejection,
}

impl SampledVerify {
    /// Parse `coupled|rejection`.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "rejection" => Self::Rejection,
            "coupled" => Self::Coupled,
            _ => return None,
        })
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Rejection => "rejection",
            Self::Coupled => "coupled",
        }
    }

    /// Whether sampled requests verify by coupling.
    pub fn coupled(&self) -> bool {
        *self == Self::Coupled
    }
}

/// Speculation settings of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpecOptions {
    pub mode: SpecMode,
    /// Maximum draft length k per target step (>= 1).
    pub draft_max: usize,
    /// Choose k per step from recent acceptance (else always `draft_max` when a draft exists).
    pub adaptive: bool,
    /// How a sampled request verifies drafts ([`SampledVerify`]); greedy requests ignore it.
    #[serde(default)]
    pub sampled_verify: SampledVerify,
}

impl Default for SpecOptions {
    fn default() -> Self {
        Self {
            mode: SpecMode::Off,
            draft_max: 4,
            adaptive: true,
            sampled_verify: SampledVerify::Coupled,
        }
    }
}

/// What a drafter proposes for one target step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Proposal {
    /// The draft tokens d1..dk (k may be smaller than asked, or zero).
    pub tokens: Vec<u32>,
    /// For a sampling drafter, `q[i]` is the distribution `tokens[i]` was drawn from, as
    /// `(token id, probability)` pairs (zero-probability tokens omitted). `None` for a
    /// deterministic drafter (q one-hot on each proposed token).
    pub q: Option<Vec<Vec<(u32, f32)>>>,
    /// The drafter's own probability of each proposed token (`[0, 1]`, one per token): its
    /// softmax at temperature 1 for a greedy draft, `q(token)` for a sampled one. `None` for a
    /// drafter without a distribution (n-gram lookup). The draft-length controller learns how
    /// it maps to acceptance ([`controller::DraftLength::calibrated`]) and cuts drafts by it
    /// (EAGLE-2, Li et al. 2024, §4: draft confidence approximates acceptance); it never changes
    /// what is committed. A sampled draft token's own confidence never decides whether it is
    /// verified (that would bias rejection sampling): only the confidences before it do.
    pub confidence: Option<Vec<f32>>,
}

impl Proposal {
    /// A deterministic proposal (q one-hot).
    pub fn deterministic(tokens: Vec<u32>) -> Self {
        Self {
            tokens,
            q: None,
            confidence: None,
        }
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Keep at most `k` tokens (and their distributions).
    pub fn truncate(&mut self, k: usize) {
        self.tokens.truncate(k);
        if let Some(q) = self.q.as_mut() {
            q.truncate(k);
        }
        if let Some(c) = self.confidence.as_mut() {
            c.truncate(k);
        }
    }
}

/// The softmax probability (temperature 1) of entry `i` of a logits row: `exp(x_i - max) /
/// Σ exp(x_j - max)`, in `[0, 1]`; 0 for an index outside the row or a row without a finite
/// entry. A drafter's confidence, so computed with [`head::exp_nonpositive`] (relative error
/// below 1e-5), which vectorizes.
pub fn softmax_probability(row: &[f32], i: usize) -> f32 {
    let Some(&xi) = row.get(i) else {
        return 0.0;
    };
    let max = crate::sampling::max_value(row);
    if !max.is_finite() {
        return 0.0;
    }
    let sum: f32 = row.iter().map(|&x| head::exp_nonpositive(x - max)).sum();
    (head::exp_nonpositive(xi - max) / sum).clamp(0.0, 1.0)
}

/// How a drafter turns a row of its logits into a draft token for one request: the request's
/// `logit_bias` first (the target's rows carry it, so a token the request bans is not drafted
/// only to be rejected, and one it favours is drafted where the target would pick it), then the
/// argmax at temperature 0, or, when sampling, a draw from the processed distribution (the
/// request's temperature, top-k, top-p and min-p; penalties off): under coupling (the default,
/// [`SampledVerify::Coupled`]) the keyed draw with the target's key at the draft token's
/// position, a deterministic draft without q; under rejection sampling a draw with the
/// drafter's own RNG, returned as q (Leviathan et al. 2023). What is committed never depends on
/// it: the target verifies every draft.
#[derive(Debug, Clone)]
pub struct DraftSampling {
    /// The request's `(token id, bias)` pairs ([`crate::sampling::SamplingParams::logit_bias`]).
    bias: Vec<(u32, f32)>,
    /// `None` at temperature 0 (argmax drafts).
    sampler: Option<crate::sampling::Sampler>,
    /// The target's draw key under [`SampledVerify::Coupled`] ([`DraftSampling::couple`]):
    /// draft tokens are then [`crate::sampling::keyed_draw`]s of q at their positions, a
    /// deterministic draft (no q).
    coupled: Option<u64>,
    /// The sequence position of the next draft token ([`DraftSampling::begin`]).
    next_pos: usize,
}

impl DraftSampling {
    /// For a request with sampling parameters `params`; `seed` seeds the drafter's RNG.
    pub fn new(params: &crate::sampling::SamplingParams, seed: u64) -> Self {
        let sampler = (!params.is_greedy()).then(|| {
            crate::sampling::Sampler::new(crate::sampling::SamplingParams {
                repetition_penalty: 1.0,
                presence_penalty: 0.0,
                frequency_penalty: 0.0,
                logit_bias: Vec::new(),
                seed: Some(seed),
                ..params.clone()
            })
        });
        Self {
            bias: params.logit_bias.clone(),
            sampler,
            coupled: None,
            next_pos: 0,
        }
    }

    /// Draw with the target's key `key` ([`crate::sampling::Sampler::noise_key`]) from now on
    /// ([`SampledVerify::Coupled`]). No effect on greedy drafting.
    pub fn couple(&mut self, key: u64) {
        self.coupled = Some(key);
    }

    /// A proposal continuing a context of `context_len` tokens starts: its first draft token
    /// is at sequence position `context_len`, and each pick is at the next position.
    pub fn begin(&mut self, context_len: usize) {
        self.next_pos = context_len;
    }

    /// Drafts are sampled from the drafter's distribution, not argmax.
    pub fn is_sampling(&self) -> bool {
        self.sampler.is_some()
    }

    /// The proposal carries q (sampled drafts for rejection sampling); false for argmax and
    /// coupled drafts, which are deterministic given the context and the key.
    pub fn carries_q(&self) -> bool {
        self.sampler.is_some() && self.coupled.is_none()
    }

    /// The request has a logit bias, which [`DraftSampling::pick`] adds to every row.
    pub fn has_bias(&self) -> bool {
        !self.bias.is_empty()
    }

    /// The request's `(token id, bias)` pairs.
    pub fn bias(&self) -> &[(u32, f32)] {
        &self.bias
    }

    /// The draft token of a full-vocabulary logits row `[vocab]` (f32; the bias is added in
    /// place), the distribution it was drawn from when sampling, and the drafter's probability
    /// of it ([`Proposal::confidence`]: the softmax at temperature 1 when greedy, q(token) when
    /// sampling).
    pub fn pick(&mut self, row: &mut [f32]) -> head::ConfidentPick {
        crate::sampling::add_logit_bias(row, &self.bias);
        self.pick_biased(row)
    }

    /// [`DraftSampling::pick`] with the row (bias added) masked by `guide` for the draft
    /// position after `drafted`, the tokens drafted so far in this step; the mask is part of
    /// the distribution drawn from, so q is still exactly that. `None` when the mask leaves no
    /// token (nothing can be drafted there).
    pub fn pick_guided(
        &mut self,
        row: &mut [f32],
        drafted: &[u32],
        guide: &mut dyn DraftGuide,
    ) -> Option<head::ConfidentPick> {
        crate::sampling::add_logit_bias(row, &self.bias);
        if guide.mask(drafted, row) && !row.iter().any(|l| l.is_finite()) {
            return None;
        }
        Some(self.pick_biased(row))
    }

    fn pick_biased(&mut self, row: &[f32]) -> head::ConfidentPick {
        let pos = self.next_pos;
        self.next_pos += 1;
        match self.sampler.as_mut() {
            None => {
                let t = crate::sampling::argmax(row);
                (t, None, softmax_probability(row, t as usize))
            }
            Some(s) => {
                let dist = s.distribution(row);
                let t = match self.coupled {
                    Some(key) => crate::sampling::keyed_draw(key, pos, &dist),
                    None => s.draw_from_stream(&dist),
                };
                let c = dist.iter().find(|&&(id, _)| id == t).map_or(0.0, |&(_, p)| p);
                (t, self.coupled.is_none().then_some(dist), c)
            }
        }
    }
}

/// What the sequence tells a model drafter while it drafts one step token by token.
pub trait DraftGuide {
    /// Whether one more token is worth drafting after tokens with these confidences (the
    /// draft-length controller's judgement, [`controller::DraftLength::go_on`]). Default: yes.
    fn go_on(&mut self, confidence: &[f32]) -> bool {
        let _ = confidence;
        true
    }
    /// Whether [`DraftGuide::mask`] masks rows (the request has a constraint: structured
    /// output, a forced tool call). Default: no.
    fn masks(&self) -> bool {
        false
    }
    /// Mask a full-vocabulary draft row `[vocab]` (f32 logits, the logit bias added) for the
    /// position after `drafted` (the tokens drafted so far in this step) as the target's verify
    /// row there will be masked (`Constraint::mask_after`): the draft then proposes only what
    /// verification can accept. Returns whether it masked. Default: leaves the row.
    fn mask(&mut self, drafted: &[u32], row: &mut [f32]) -> bool {
        let _ = (drafted, row);
        false
    }
}

/// A [`DraftGuide`] that lets a drafter draft all k tokens from unmasked rows
/// ([`Drafter::propose`]).
pub struct Unguided;

impl DraftGuide for Unguided {}

/// A drafter: proposes up to k tokens continuing the committed context.
///
/// Drafters are stateless from the engine's point of view: each call gets the whole committed
/// context (prompt + output so far), and a drafter that keeps state (a draft model's KV cache)
/// rolls it back itself to the longest prefix it shares with `context`. Verification never trusts
/// a draft: whatever a drafter proposes, the committed tokens are what the target decides.
pub trait Drafter: Send {
    /// Propose up to `k` tokens continuing `context`. May return fewer, or none.
    fn propose(&mut self, context: &[u32], k: usize) -> anyhow::Result<Proposal>;
    /// [`Drafter::propose`] under a [`DraftGuide`]: a drafter that drafts token by token and
    /// knows its [`Proposal::confidence`] asks [`DraftGuide::go_on`] with the confidences so far
    /// before each further token, and stops when it answers false (the draft-length
    /// controller's judgement that one more token would not pay); a drafter with logits rows
    /// has each row masked by [`DraftGuide::mask`] before it picks (the request's constraint).
    /// The default ignores the guide.
    fn propose_guided(&mut self, context: &[u32], k: usize, guide: &mut dyn DraftGuide) -> anyhow::Result<Proposal> {
        let _ = guide;
        self.propose(context, k)
    }
    /// A short name for stats and logs.
    fn name(&self) -> &'static str;
    /// The target hidden states this drafter reads, as [`crate::model::Model::forward`] tap
    /// indices (block `i`'s output; `num_layers` = after the final norm). Empty (the default)
    /// for drafters that read only tokens.
    fn taps(&self) -> &[usize] {
        &[]
    }
    /// The target's hidden states at committed positions `start .. start + n`: one row-major
    /// `[n, hidden]` f32 buffer per tap, in [`Drafter::taps`] order. Called after every target
    /// forward with the rows that were committed (every prompt row; the fed token and the
    /// accepted drafts of a verify), before the next [`Drafter::propose`]. Positions before the
    /// first observed one (a prefix-cache hit) are never observed.
    fn observe(&mut self, start: usize, n: usize, hidden: &[&[f32]]) -> anyhow::Result<()> {
        let _ = (start, n, hidden);
        Ok(())
    }
    /// Seconds of the last [`Drafter::propose`] spent catching up on context (a draft model
    /// feeding committed tokens it had not seen, or re-seeding; an MTP head or block drafter
    /// feeding the hidden-state rows of more positions than the last verify committed), not
    /// drafting. The draft-length
    /// controller prices drafts by the rest, so a catch-up after a pause is not mistaken for the
    /// cost of every draft token.
    fn last_catch_up_s(&self) -> f64 {
        0.0
    }

    /// How many context tokens a proposal continuing `context` would feed before drafting,
    /// beyond a steady step's (the catch-up whose seconds [`Drafter::last_catch_up_s`] reports).
    /// 0 (the default) for drafters that read the target's hidden states as it runs or read
    /// nothing: they have nothing to catch up on before their first draft. A draft model
    /// feeds the whole prompt (or a window of it) first; the controller weighs that before
    /// starting it ([`controller::DraftLength::start_pays`]).
    fn catch_up_tokens(&self, context: &[u32]) -> usize {
        let _ = context;
        0
    }

    /// The longest pause the draft-length controller should take between probes, when a probe
    /// costs this drafter more than its drafts (None: the controller's default).
    fn max_pause(&self) -> Option<usize> {
        None
    }

    /// Whether a proposal costs the same however many tokens it holds (a block drafter drafts
    /// its whole block in one pass): the draft-length controller then prices drafting per
    /// proposal, not per token, so a short draft is not mistaken for a cheap one.
    fn priced_per_pass(&self) -> bool {
        false
    }

    /// Draw sampled drafts with the target's draw key `key` from now on
    /// ([`SampledVerify::Coupled`], [`DraftSampling::couple`]): the proposals are then
    /// deterministic (no q). The default (drafters without a distribution) ignores it.
    fn couple(&mut self, key: u64) {
        let _ = key;
    }
}

/// Per-request speculation counters.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SpecStats {
    /// "ar", or the drafter's name; with the reason when speculation was asked for but not used.
    pub decode_path: String,
    /// How drafts were verified: "greedy", "rejection" or "coupled" ([`SampledVerify`]);
    /// empty when nothing was drafted for (plain decoding).
    pub verify: &'static str,
    /// Draft tokens verified by the target.
    pub drafted: usize,
    /// Draft tokens accepted that reached the output: a verified block cut at EOS, a stop
    /// string or `max_tokens` counts the drafts up to the one that ends the output (an EOS or
    /// the last token of a stop string is in the output's token count) and none after it, so
    /// `accepted` ≤ `committed` ≤ `accepted` + `target_steps`.
    pub accepted: usize,
    /// Draft tokens proposed but not verified: the batch's draft budget
    /// ([`controller::draft_budget`]) dropped them because the step was cheaper without them,
    /// or the controller cut them by the drafter's calibrated confidence
    /// ([`controller::DraftLength::cut`]).
    pub trimmed: usize,
    /// Target forward passes after prefill.
    pub target_steps: usize,
    /// Tokens committed by those steps.
    pub committed: usize,
    /// Accepted count per draft position (index 0 = first draft token).
    pub accepted_by_position: Vec<usize>,
    /// Drafted count per draft position.
    pub drafted_by_position: Vec<usize>,
    /// Of `drafted` / `accepted`: the draft tokens n-gram lookup proposed in place of the
    /// model drafter (`on` / `default` with a model drafter: decode path `…+ngram`; see
    /// [`crate::sequence::Sequence`]), and how many were accepted.
    pub lookup_drafted: usize,
    pub lookup_accepted: usize,
    /// A model drafter that must catch up on the context first (a draft model, adaptive k)
    /// starts when its catch-up pays ([`controller::DraftLength::start_pays`]) or at a probe:
    /// the output tokens committed when that was decided (n-gram lookup may still draft that
    /// step). None when it never started, or started without waiting (fixed k, a drafter
    /// with nothing to catch up on, `SPECULA_DEFER_START=0`).
    pub model_started_at: Option<usize>,
    /// Seconds spent in the drafter.
    pub draft_s: f64,
    /// Target forwards after prefill by row count: entry `r - 1` holds (forwards, seconds) of
    /// r-row forwards (r = 1 is a plain decode step, r = k + 1 a verify of k drafts).
    pub forwards_by_rows: Vec<(usize, f64)>,
}

impl SpecStats {
    /// Mean tokens committed per target step (tau).
    pub fn tau(&self) -> f64 {
        if self.target_steps == 0 {
            0.0
        } else {
            self.committed as f64 / self.target_steps as f64
        }
    }

    /// Accepted / drafted.
    pub fn acceptance_rate(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }

    /// The stats as the JSON object the CLI (`generate --json`) and the server (`spec_stats`)
    /// report: counters, tau, acceptance overall and by draft position, drafter seconds, and
    /// the mean milliseconds of target forwards by row count.
    pub fn to_json(&self) -> serde_json::Value {
        let by_pos: Vec<f64> = self
            .accepted_by_position
            .iter()
            .zip(&self.drafted_by_position)
            .map(|(&a, &d)| if d == 0 { 0.0 } else { a as f64 / d as f64 })
            .collect();
        let forwards: Vec<serde_json::Value> = self
            .forwards_by_rows
            .iter()
            .enumerate()
            .filter(|(_, &(n, _))| n > 0)
            .map(|(i, &(n, s))| serde_json::json!({"rows": i + 1, "count": n, "mean_ms": 1e3 * s / n as f64}))
            .collect();
        serde_json::json!({
            "decode_path": self.decode_path,
            "verify": self.verify,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "trimmed": self.trimmed,
            "acceptance_rate": self.acceptance_rate(),
            "target_steps": self.target_steps,
            "committed": self.committed,
            "tau": self.tau(),
            "drafted_by_position": self.drafted_by_position,
            "accepted_by_position": self.accepted_by_position,
            "acceptance_by_position": by_pos,
            "lookup_drafted": self.lookup_drafted,
            "lookup_accepted": self.lookup_accepted,
            "model_started_at": self.model_started_at,
            "draft_s": self.draft_s,
            "target_forwards": forwards,
        })
    }

    /// Mean seconds of an r-row target forward, if any ran.
    pub fn mean_forward_s(&self, rows: usize) -> Option<f64> {
        let &(n, s) = self.forwards_by_rows.get(rows.checked_sub(1)?)?;
        (n > 0).then(|| s / n as f64)
    }

    pub(crate) fn record_forward(&mut self, rows: usize, seconds: f64) {
        if rows == 0 {
            return;
        }
        if self.forwards_by_rows.len() < rows {
            self.forwards_by_rows.resize(rows, (0, 0.0));
        }
        let e = &mut self.forwards_by_rows[rows - 1];
        e.0 += 1;
        e.1 += seconds;
    }

    pub(crate) fn record(&mut self, drafted: usize, accepted: usize) {
        self.drafted += drafted;
        self.accepted += accepted;
        if self.drafted_by_position.len() < drafted {
            self.drafted_by_position.resize(drafted, 0);
            self.accepted_by_position.resize(drafted, 0);
        }
        for i in 0..drafted {
            self.drafted_by_position[i] += 1;
            if i < accepted {
                self.accepted_by_position[i] += 1;
            }
        }
    }
}
