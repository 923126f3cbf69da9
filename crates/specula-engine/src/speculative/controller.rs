//! Draft-length controller: chooses k for each target step from the measured acceptance and the
//! measured costs of verifying and drafting, and stops drafting when it does not pay.
//!
//! Model (Leviathan et al. 2023, §3.1 and §3.4, with the acceptance made per draft position as
//! in SpecDec++ / the "acceptance by position" of EAGLE's reports): with `α_j` the probability
//! that the j-th draft token is accepted given that the ones before it were, a step that drafts
//! k tokens commits on average `E(k) = Σ_{i=0..=k} Π_{j≤i} α_j` tokens (accepted drafts plus the
//! target's own token), and costs `V(k+1) + k·D` where `V(r)` is the time of an r-row target
//! forward and `D` the drafter's time per token. Plain decoding commits one token per `V(1)`.
//! The controller picks the k in `1..=draft_max` with the best predicted speed-up
//! `E(k)·V(1) / (V(k+1) + k·D)`; when no k beats 1.0 even with `α_1` one standard error above
//! its estimate (a few early rejections are weak evidence), it pauses drafting for a number of
//! steps that doubles while probes keep failing (up to [`MAX_PAUSE`], or the drafter's own
//! maximum) and resets after a probe after which drafting pays on that same optimistic estimate.
//!
//! Estimates: `α_1` is `(accepted + 1) / (tested + 2)` over exponentially decayed counts of the
//! first draft position; `α_j` for a later position is its own decayed counts plus
//! [`LATER_PRIOR`] pseudo-observations at `α_{j-1}`, so a position never tested is taken to be as
//! good as the one before it (a geometric law: the estimate starts where a single pooled α
//! would). A step's tested positions are its accepted drafts plus the rejected one (positions
//! after the first rejection were never tested); a position a step did not test keeps its counts
//! but lets them fade by [`UNTESTED_DECAY`], so after a run of short drafts a longer one is tried
//! again. One α for all positions would be wrong for the drafters whose later positions differ
//! from the first: a chained MTP head accepts its second draft at about half the rate of its
//! first, and n-gram lookup's continuation of a confirmed match is accepted more often than the
//! match's first token. `V(r)` and `D` are exponential moving averages of the
//! timings the engine reports; a `V(r)` not yet measured is interpolated linearly between
//! measured row counts (prior slope: 10% of `V(1)` per extra row, the weights being read once).
//! Timing noise changes only k, never the committed tokens.
//!
//! A drafter that must catch up after a pause (a draft model feeds the tokens committed while it
//! was paused) pays that once per probe, not per draft token. The controller prices it as part
//! of drafting, spread over the draft tokens of recent steps (decayed sums of probe catch-up
//! seconds and of draft tokens): where runs of drafting are long (code), a catch-up is spread
//! thin; where drafting hovers at break-even and every few steps end in a pause (prose), the
//! catch-ups add up, drafting stops paying, and the pauses grow instead of resetting.
//!
//! A draft model's first catch-up (the end of the context, before its first draft) is weighed
//! before it is paid ([`DraftLength::start_pays`], a ski rental): the request decodes without
//! the drafter (with n-gram lookup beside it, or plainly) until the tokens committed so far
//! would have saved the catch-up had the drafter run, and the drafter never starts while the
//! tokens left could not pay it back (a probe after a pause starts it regardless). On the Qwen
//! pair on a 2-core CPU the catch-up costs about as much as a one-sentence answer's whole
//! decode saves (docs/perf.md).

use crate::model::ModelConfig;

/// Longest pause (in target steps) between probes when drafts keep failing.
pub const MAX_PAUSE: usize = 32;
/// Decay of a draft position's acceptance counts per step that tests it.
const ACCEPT_DECAY: f64 = 0.9;
/// Decay of a draft position's acceptance counts per drafting step that does not test it.
const UNTESTED_DECAY: f64 = 0.97;
/// Pseudo-observations at the previous position's rate in a later position's estimate.
pub const LATER_PRIOR: f64 = 1.0;
/// Weight of a new timing in the moving averages.
const TIME_ALPHA: f64 = 0.25;
/// Prior cost of one extra verify row, as a fraction of a one-row forward.
const PRIOR_ROW_SLOPE: f64 = 0.1;
/// Drafting steps between two one-row (no draft) steps that re-measure the unit of every cost.
const RECALIBRATE_EVERY: usize = 32;
/// Target forwards after which a row count's timing is stale ([`DraftLength::timing_stale`]).
const STALE_FORWARDS: usize = 16;

/// Draft seconds per token, as a fraction of a plain decoding token's, above which a drafter
/// whose draft the batch budget dropped backs off ([`DraftLength::note_trimmed`]).
const COSTLY_DRAFT: f64 = 0.02;

/// Decay of the probe catch-up and draft-token sums, per drafting step.
const CATCH_UP_DECAY: f64 = 0.97;
/// Fewest catch-up tokens whose seconds are taken as a measure of the catch-up's cost per
/// token ([`DraftLength::observe_catch_up`]): a feed of a few tokens costs about one draft
/// step whatever its length (the weights are read once), so its cost per token says little
/// about a prompt's.
pub const MIN_CATCH_UP_SAMPLE: usize = 16;

/// Weight of the older steps in the [`BatchCost`] fit, per step.
const BATCH_DECAY: f64 = 0.97;

/// Confidence buckets of [`Calibration`] (equal widths over `[0, 1]`).
const CAL_BUCKETS: usize = 10;
/// Draft-position groups of [`Calibration`]: the first draft, the second, the rest (a chained
/// head's later drafts are less reliable than their confidence says).
const CAL_GROUPS: usize = 3;
/// Pseudo-observations at the raw confidence in a bucket's estimate.
const CAL_PRIOR: f64 = 2.0;
/// Decay of a bucket's counts per tested token that falls in it.
const CAL_DECAY: f64 = 0.995;

/// Acceptance as a function of the drafter's own confidence ([`super::Proposal::confidence`]),
/// learned online: decayed (accepted, tested) counts per draft-position group and confidence
/// bucket, each estimate pulled towards the raw confidence by [`CAL_PRIOR`] pseudo-observations
/// (so a new drafter starts by trusting its confidence). A token is tested when every draft
/// before it was accepted.
#[derive(Debug, Clone, Default)]
struct Calibration {
    counts: [[(f64, f64); CAL_BUCKETS]; CAL_GROUPS],
    /// Whether the drafter reports confidences (set by the first observation).
    seen: bool,
}

impl Calibration {
    fn cell(position: usize, confidence: f32) -> (usize, usize) {
        let c = f64::from(confidence).clamp(0.0, 1.0);
        (
            position.min(CAL_GROUPS - 1),
            ((c * CAL_BUCKETS as f64) as usize).min(CAL_BUCKETS - 1),
        )
    }

    /// Estimated probability that a draft at 0-based `position` with `confidence` is accepted,
    /// given that the drafts before it were.
    fn estimate(&self, position: usize, confidence: f32) -> f64 {
        let (g, b) = Self::cell(position, confidence);
        let (a, t) = self.counts[g][b];
        ((a + CAL_PRIOR * f64::from(confidence).clamp(0.0, 1.0)) / (t + CAL_PRIOR)).clamp(0.0, 0.999)
    }

    /// Feed a verified draft's confidences and how many of its tokens were accepted.
    fn update(&mut self, confidence: &[f32], accepted: usize) {
        self.seen = true;
        let tested = (accepted + 1).min(confidence.len());
        for (j, &c) in confidence.iter().enumerate().take(tested) {
            let (g, b) = Self::cell(j, c);
            let (a, t) = &mut self.counts[g][b];
            *a = CAL_DECAY * *a + f64::from(u8::from(j < accepted));
            *t = CAL_DECAY * *t + 1.0;
        }
    }
}

/// What drafting costs a sequence that shares the target forward with others (continuous
/// batching): the marginal seconds of one more row in the batched forward, and the seconds per
/// committed token of plain decoding at the current concurrency.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Load {
    pub row_s: f64,
    pub token_s: f64,
}

/// Engine-wide model of a batched target forward's time, `T(R) ≈ a + b·R` for `R` rows, fitted
/// by exponentially weighted least squares over recent steps. Under load the controller weighs a
/// draft by this marginal row cost instead of its own solo verify timings: when a batch of B
/// sequences already keeps the cores busy, k more rows cost about `k·b`, while plain decoding
/// commits a token per `(a + b·B)/B`. So drafting shrinks as the batch grows, and stops where it
/// would lower aggregate throughput below AR (issue "Continuous batching": "under load the draft
/// length shrinks").
#[derive(Debug, Clone, Default)]
pub struct BatchCost {
    w: f64,
    r: f64,
    rr: f64,
    t: f64,
    rt: f64,
    /// The last determined fit: kept while the row counts stop varying (when every sequence
    /// has stopped drafting), so the decision does not flip back to the solo timings.
    last: Option<(f64, f64)>,
    /// Moving average of the seconds of an R-row forward and how many fed it, at index R (up
    /// to [`MEASURED_ROWS`]): the kernels' cost is not linear in R (a row past a multiple of
    /// the tile's row group starts another group, which re-reads and unpacks the weights:
    /// 16 -> 17 rows cost 2.8 ms on the Qwen 0.5B where the fit's slope said 1.6), so the
    /// batch's draft budget reads the forward times from these where measured
    /// ([`BatchCost::time`], [`draft_budget`]).
    by_rows: Vec<(f64, u32)>,
}

/// Row counts whose forward times [`BatchCost`] keeps one by one.
const MEASURED_ROWS: usize = 256;

/// Observations of a row count before its average is trusted over the fit.
const MEASURED_MIN: u32 = 3;

impl BatchCost {
    /// Feed the seconds of a batched forward of `rows` rows.
    pub fn observe(&mut self, rows: usize, seconds: f64) {
        let r = rows as f64;
        self.w = BATCH_DECAY * self.w + 1.0;
        self.r = BATCH_DECAY * self.r + r;
        self.rr = BATCH_DECAY * self.rr + r * r;
        self.t = BATCH_DECAY * self.t + seconds;
        self.rt = BATCH_DECAY * self.rt + r * seconds;
        if let Some(f) = self.fit() {
            self.last = Some(f);
        }
        if rows < MEASURED_ROWS {
            if self.by_rows.len() <= rows {
                self.by_rows.resize(rows + 1, (0.0, 0));
            }
            let (t, n) = &mut self.by_rows[rows];
            *t = if *n == 0 {
                seconds
            } else {
                TIME_ALPHA * seconds + (1.0 - TIME_ALPHA) * *t
            };
            *n = n.saturating_add(1);
        }
    }

    /// The measured seconds of an `rows`-row forward, once [`MEASURED_MIN`] fed it.
    fn measured(&self, rows: usize) -> Option<f64> {
        self.by_rows
            .get(rows)
            .filter(|(_, n)| *n >= MEASURED_MIN)
            .map(|&(t, _)| t)
    }

    /// `(a, b)`: fixed seconds per forward and seconds per row, once the recent row counts have
    /// varied by at least a row (standard deviation) and both come out positive.
    pub fn fit(&self) -> Option<(f64, f64)> {
        let var = self.w * self.rr - self.r * self.r;
        if self.w < 4.0 || var < self.w * self.w {
            return None;
        }
        let b = (self.w * self.rt - self.r * self.t) / var;
        let a = (self.t - b * self.r) / self.w;
        (a > 0.0 && b > 0.0).then_some((a, b))
    }

    /// Estimated seconds of an `rows`-row forward: the measured average where
    /// [`MEASURED_MIN`] steps fed it; else the nearest measured row count below plus the fit's
    /// slope per row in between (a row past a measured boundary costs what the rows after a
    /// boundary cost); else the fit's `a + b·rows`. None before any fit.
    pub fn time(&self, rows: usize) -> Option<f64> {
        if let Some(t) = self.measured(rows) {
            return Some(t);
        }
        let (a, b) = self.last?;
        let below = (1..rows.min(self.by_rows.len()))
            .rev()
            .find_map(|r| self.measured(r).map(|t| (r, t)));
        Some(match below {
            Some((r, t)) => t + self.slope_past(r, b) * (rows - r) as f64,
            None => a + b * rows as f64,
        })
    }

    /// Seconds per row past the measured row count `rows`: the fit's slope `b`, or the measured
    /// curve's own slope from a quarter of the way below (the secant to the nearest measured
    /// count at most `3·rows/4`) where that is steeper. Past a few dozen rows on two cores the
    /// curve bends up (plain decoding of the Qwen 0.5B ran 368 tok/s at 32 rows and 328-380 at
    /// 64): there the fit's average slope, mostly from smaller batches, underprices a row, while
    /// plain decoding's token is priced by the measured `T(rows)/rows`, so drafts at 88%
    /// acceptance looked worth a row and lowered the aggregate (`docs/perf.md`).
    fn slope_past(&self, rows: usize, b: f64) -> f64 {
        let Some(t) = self.measured(rows) else {
            return b;
        };
        (1..=rows * 3 / 4)
            .rev()
            .find_map(|r| self.measured(r).map(|u| (t - u) / (rows - r) as f64))
            .map_or(b, |s| s.max(b))
    }

    /// The [`Load`] each of `sequences` sequences sharing a forward sees (None alone, or before
    /// the fit is determined: the controller then uses its own timings): plain decoding's
    /// seconds per token (the measured `sequences`-row forward, else the fit's), and per extra
    /// row the fit's slope, or the measured curve's where it is steeper there
    /// ([`BatchCost::slope_past`]).
    ///
    /// The slope prices a row on average; the steps of the real curve (a row past a row-group
    /// boundary costs several rows' worth, the rows after it little) are shared by every
    /// sequence that drafts in a step, so they are priced once per step, by [`draft_budget`].
    pub fn load(&self, sequences: usize) -> Option<Load> {
        if sequences < 2 {
            return None;
        }
        let (a, b) = self.last?;
        let n = sequences as f64;
        Some(Load {
            row_s: self.slope_past(sequences, b),
            token_s: self.measured(sequences).unwrap_or(a + b * n) / n,
        })
    }
}

/// One sequence's draft in a batched step, as [`draft_budget`] weighs it.
#[derive(Debug, Clone, PartialEq)]
pub struct PendingDraft {
    /// Draft tokens the sequence would verify.
    pub len: usize,
    /// Its controller's conditional acceptance estimates ([`DraftLength::alphas`], `len`
    /// entries; a shorter list repeats its last): the `j`-th draft token (1-based) is committed
    /// with probability `alphas[0]·…·alphas[j-1]`.
    pub alphas: Vec<f64>,
    /// False for a fixed draft length (`adaptive = false`): kept whole.
    pub trimmable: bool,
}

/// How many draft tokens each sequence of a batched step keeps: the batch's draft budget.
///
/// Each sequence's controller chooses its k from its own acceptance and the batch's average row
/// cost; the forward's real cost curve `T(R)` has steps (a row past a row-group boundary starts
/// another pass over the weights), and a step is paid once by the whole batch however many of
/// its sequences draft. So the step as a whole keeps the `m` most valuable draft tokens (the
/// `j`-th of a sequence is worth `Π_{i≤j} α_i` expected committed tokens; a sequence keeps a prefix
/// of its draft) that maximise the step's expected tokens per second,
/// `(decoding + value(m)) / T(fixed_rows + m)`, with `T` from `cost` ([`BatchCost::time`], made
/// non-decreasing in R). `m = 0` is plain decoding for the trimmable sequences, so a kept draft
/// is one the measured costs say raises the step's throughput above AR's.
///
/// `fixed_rows`: rows of the step no draft decides (decode rows, prompt chunks, fixed-length
/// drafts go in through `drafts`); `decoding`: sequences that commit a token this step.
/// Returns one entry per `drafts` entry; everything is kept while `cost` has no estimate.
/// Verification is untouched: trimming a draft changes only how many tokens a step can commit.
pub fn draft_budget(fixed_rows: usize, decoding: usize, drafts: &[PendingDraft], cost: &BatchCost) -> Vec<usize> {
    let mut keep: Vec<usize> = drafts.iter().map(|d| if d.trimmable { 0 } else { d.len }).collect();
    let value = |d: &PendingDraft, j: usize| {
        let last = d.alphas.last().copied().unwrap_or(0.0);
        (0..j)
            .map(|i| d.alphas.get(i).copied().unwrap_or(last).clamp(0.0, 1.0))
            .product::<f64>()
    };
    let mut rows = fixed_rows + keep.iter().sum::<usize>();
    let mut tokens = decoding as f64
        + drafts
            .iter()
            .filter(|d| !d.trimmable)
            .map(|d| (1..=d.len).map(|j| value(d, j)).sum::<f64>())
            .sum::<f64>();
    // Candidates (value, sequence, position), best first; a sequence's positions come in order.
    let mut cands: Vec<(f64, usize, usize)> = drafts
        .iter()
        .enumerate()
        .filter(|(_, d)| d.trimmable)
        .flat_map(|(i, d)| (1..=d.len).map(move |j| (value(d, j), i, j)))
        .collect();
    if cands.is_empty() {
        return keep;
    }
    // Without an estimate (no fit yet: every step so far had the same row count) the drafts
    // are verified, and their steps measure the rows past them.
    let Some(t0) = cost.time(rows) else {
        return drafts.iter().map(|d| d.len).collect();
    };
    cands.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.2.cmp(&y.2)).then(x.1.cmp(&y.1)));
    let (mut t, mut best, mut best_m) = (t0, tokens / t0.max(1e-12), 0);
    for (m, &(v, _, _)) in cands.iter().enumerate() {
        rows += 1;
        tokens += v;
        let Some(x) = cost.time(rows) else { break };
        t = x.max(t);
        let score = tokens / t.max(1e-12);
        if score > best {
            (best, best_m) = (score, m + 1);
        }
    }
    for &(_, i, _) in &cands[..best_m] {
        keep[i] += 1;
    }
    keep
}

/// The per-request draft-length controller.
#[derive(Debug, Clone)]
pub struct DraftLength {
    max: usize,
    adaptive: bool,
    /// Decayed counts of accepted and tested drafts, per draft position (index j - 1 for the
    /// j-th draft token of a step).
    accepted: Vec<f64>,
    tested: Vec<f64>,
    /// Moving average of the seconds of an r-row target forward, at index r - 1.
    forward_s: Vec<Option<f64>>,
    /// The value of `forwards` when each `forward_s` entry was last fed by this request (None:
    /// not yet; a warm start's entries are the prior's).
    forward_fed: Vec<Option<usize>>,
    /// Target forwards observed.
    forwards: usize,
    /// Moving average of the drafter's seconds per proposed token.
    draft_token_s: Option<f64>,
    /// Drafting is priced per proposal ([`super::Drafter::priced_per_pass`]): `draft_token_s`
    /// and the catch-up's spread are per pass, and a draft of any length pays one.
    per_pass: bool,
    /// Decayed sums of the catch-up seconds probes paid and of the tokens drafted.
    catch_up_s: f64,
    drafted: f64,
    pause: usize,
    backoff: usize,
    probing: bool,
    /// Drafting steps since the last one-row forward was measured.
    since_one_row: usize,
    /// The last [`DraftLength::next_k`] asked for a plain step to measure the one-row forward.
    measuring: bool,
    /// Set while the sequence shares the target forward with others ([`BatchCost::load`]).
    load: Option<Load>,
    /// Longest pause between probes ([`MAX_PAUSE`] unless the drafter sets another).
    max_pause: usize,
    /// Acceptance by the drafter's confidence, for drafters that report one.
    calibration: Calibration,
    /// The drafter's seconds per draft token relative to a one-row target forward, assumed
    /// until `draft_token_s` is measured ([`DraftLength::set_draft_cost_prior`]; 0: none).
    draft_cost_prior: f64,
    /// Seconds per context token of the drafter's catch-up ([`super::Drafter::catch_up_tokens`]):
    /// measured, or a prior ([`DraftLength::set_catch_up_prior`]); None: unknown.
    catch_up_token_s: Option<f64>,
    /// Whether `catch_up_token_s` was measured (a prior gives way to the first measurement).
    catch_up_measured: bool,
    /// [`DraftLength::set_verify_prior`]: the prior cost of r rows at `r - 1`; empty: the
    /// dense default.
    verify_prior: Vec<f64>,
}

/// The prior of an r-row target forward's cost relative to a one-row forward, before any is
/// measured: the weights a forward reads, plus [`PRIOR_ROW_SLOPE`] of a one-row forward per
/// extra row for the arithmetic. A dense model reads every weight once whatever the rows; an
/// MoE model reads the experts its rows are routed to, `E (1 - (1 - k/E)^r)` distinct experts
/// of `E` per layer when `r` rows each take `k` independently (an upper estimate: a text's
/// tokens share experts more than that), so its verify grows faster with rows.
pub fn verify_cost_prior(target: &ModelConfig, rows: usize) -> f64 {
    let rows = rows.max(1);
    let arithmetic = 1.0 + PRIOR_ROW_SLOPE * (rows - 1) as f64;
    let Some(m) = &target.moe else { return arithmetic };
    let moe_layers = m.layers.iter().filter(|&&b| b).count() as f64;
    let expert = (3 * target.hidden_size * m.expert_intermediate_size) as f64;
    let one_row = target.step_params() as f64;
    let (e, k) = (m.experts as f64, m.experts_per_token as f64);
    if one_row <= 0.0 || e <= 0.0 {
        return arithmetic;
    }
    let distinct = e * (1.0 - (1.0 - k / e).powi(rows as i32));
    let extra_reads = moe_layers * expert * (distinct - k) / one_row;
    arithmetic + extra_reads
}

/// A draft model's size relative to its target's: the prior of its costs until they are
/// measured ([`DraftLength::set_draft_cost_prior`], [`DraftLength::set_catch_up_prior`]).
/// Counts of weights ([`ModelConfig::block_params`], [`ModelConfig::step_params`]), so two
/// models of one quantization mix compare as their bytes do.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SizeRatio {
    /// Draft step weights over target step weights: a draft token's cost in one-row target
    /// forwards (a decode step reads every weight once).
    pub step: f64,
    /// Draft block weights over target block weights: a catch-up token's cost in target
    /// prefill tokens (neither computes logits).
    pub blocks: f64,
}

impl SizeRatio {
    /// The ratio of `draft` to `target`, the draft computing `draft_logit_rows` logits a step
    /// (its vocabulary, or the reduced one of `--draft-vocab`: [`crate::model::Model::logit_rows`]);
    /// 1.0 where the target has no weights to compare with.
    pub fn of(draft: &ModelConfig, draft_logit_rows: usize, target: &ModelConfig) -> Self {
        let ratio = |d: usize, t: usize| if t == 0 { 1.0 } else { d as f64 / t as f64 };
        Self {
            step: ratio(draft.step_params_over(draft_logit_rows), target.step_params()),
            blocks: ratio(draft.block_params(), target.block_params()),
        }
    }
}

impl DraftLength {
    /// `max` = draft_max (k never exceeds it); `adaptive = false` always asks for `max`.
    pub fn new(max: usize, adaptive: bool) -> Self {
        let max = max.max(1);
        Self {
            max,
            adaptive,
            // Optimistic prior: drafting is tried from the first step.
            accepted: (0..max).map(|j| if j == 0 { 1.5 } else { 0.0 }).collect(),
            tested: (0..max).map(|j| if j == 0 { 2.0 } else { 0.0 }).collect(),
            forward_s: vec![None; max + 1],
            forward_fed: vec![None; max + 1],
            forwards: 0,
            draft_token_s: None,
            per_pass: false,
            catch_up_s: 0.0,
            drafted: 0.0,
            pause: 0,
            backoff: 1,
            probing: false,
            since_one_row: 0,
            measuring: false,
            load: None,
            max_pause: MAX_PAUSE,
            calibration: Calibration::default(),
            draft_cost_prior: 0.0,
            catch_up_token_s: None,
            catch_up_measured: false,
            verify_prior: Vec::new(),
        }
    }

    /// Start from what an earlier request with the same drafter learned (acceptance counts,
    /// measured costs, a draft model's catch-up seconds per token): a new request then does not
    /// pay again to find out that drafting does not pay. When the prior predicts a loss, the
    /// request starts paused for the longest back-off (a draft model also skips its catch-up
    /// until the probe that ends it). A fixed k ignores priors.
    pub fn warm_start(&mut self, prior: &DraftLength) {
        if !self.adaptive {
            return;
        }
        for (j, (a, t)) in self.accepted.iter_mut().zip(self.tested.iter_mut()).enumerate() {
            *a = prior.accepted.get(j).copied().unwrap_or(0.0);
            *t = prior.tested.get(j).copied().unwrap_or(0.0);
        }
        for (mine, theirs) in self.forward_s.iter_mut().zip(&prior.forward_s) {
            *mine = *theirs;
        }
        // The prior's timings were taken at another context length: each is replaced by this
        // request's first measurement of its row count (`observe_forward`).
        self.calibration = prior.calibration.clone();
        self.draft_token_s = prior.draft_token_s;
        self.catch_up_s = prior.catch_up_s;
        self.drafted = prior.drafted;
        if prior.catch_up_measured {
            self.catch_up_token_s = prior.catch_up_token_s;
            self.catch_up_measured = true;
        }
        if self.forward_s[0].is_some() && self.best_optimistic().1 < 1.0 {
            self.pause = self.max_pause;
            self.backoff = self.max_pause;
        }
    }

    /// Whether k adapts (false: always `draft_max`).
    pub fn adaptive(&self) -> bool {
        self.adaptive
    }

    /// The estimated acceptance probability of the first draft token, `α_1`.
    pub fn alpha(&self) -> f64 {
        self.alphas(1)[0]
    }

    /// The estimated conditional acceptance probabilities `α_1..α_n` (index j - 1: the j-th draft
    /// token is accepted given that the ones before it were), in `[0, 0.999]`; positions past
    /// `draft_max` repeat the last.
    pub fn alphas(&self, n: usize) -> Vec<f64> {
        self.alphas_with(n, false)
    }

    /// [`DraftLength::alphas`], with `optimistic`: `α_1` raised by one standard error of its
    /// estimate, `sqrt(α(1 − α) / (n + 2))` for `n` (decayed) tests, the later positions
    /// following it through their prior. Pausing is decided on this upper estimate
    /// (optimism under uncertainty, as in UCB bandits): a few early rejections are weak
    /// evidence, and a pause is costly to leave, since a probe must then show a gain on its
    /// own. Where a failed draft costs little (a cheap drafter, a verify row about as dear as
    /// a decode row) an estimate near break-even keeps drafting until the evidence is firm.
    fn alphas_with(&self, n: usize, optimistic: bool) -> Vec<f64> {
        let mut out = Vec::with_capacity(n);
        let mut prev = ((self.accepted[0] + 1.0) / (self.tested[0] + 2.0)).clamp(0.0, 0.999);
        if optimistic {
            prev = (prev + (prev * (1.0 - prev) / (self.tested[0] + 2.0)).sqrt()).clamp(0.0, 0.999);
        }
        for j in 0..n {
            if j > 0 && j < self.max {
                prev = ((self.accepted[j] + LATER_PRIOR * prev) / (self.tested[j] + LATER_PRIOR)).clamp(0.0, 0.999);
            }
            out.push(prev);
        }
        out
    }

    /// Expected tokens committed by a step that drafts `k` tokens: `Σ_{i=0..=k} Π_{j≤i} α_j`.
    pub fn expected_tokens(&self, k: usize) -> f64 {
        self.expected_tokens_with(k, false)
    }

    fn expected_tokens_with(&self, k: usize, optimistic: bool) -> f64 {
        let mut reach = 1.0;
        let mut sum = 1.0;
        for a in self.alphas_with(k, optimistic) {
            reach *= a;
            sum += reach;
        }
        sum
    }

    /// The prior of [`DraftLength::relative_forward_cost`] at `rows`: the target's
    /// ([`DraftLength::set_verify_prior`]), or [`PRIOR_ROW_SLOPE`] per extra row.
    fn prior_cost(&self, rows: usize) -> f64 {
        match self.verify_prior.get(rows.wrapping_sub(1)) {
            Some(&c) => c,
            None => 1.0 + PRIOR_ROW_SLOPE * (rows.saturating_sub(1)) as f64,
        }
    }

    /// Price unmeasured row counts by the target's prior ([`verify_cost_prior`]; `prior[r - 1]`
    /// for r rows) instead of the dense default.
    pub fn set_verify_prior(&mut self, prior: Vec<f64>) {
        self.verify_prior = prior;
    }

    /// Estimated seconds of an r-row target forward, relative to a one-row forward.
    pub fn relative_forward_cost(&self, rows: usize) -> f64 {
        let Some(t1) = self.forward_s.first().copied().flatten() else {
            return self.prior_cost(rows);
        };
        if let Some(Some(t)) = self.forward_s.get(rows.wrapping_sub(1)) {
            return t / t1;
        }
        // Interpolate between the nearest measured row counts (or extend the last slope).
        let measured: Vec<(usize, f64)> = self
            .forward_s
            .iter()
            .enumerate()
            .filter_map(|(i, t)| t.map(|t| (i + 1, t / t1)))
            .collect();
        let below = measured
            .iter()
            .rev()
            .find(|(r, _)| *r < rows)
            .copied()
            .unwrap_or((1, 1.0));
        let above = measured.iter().find(|(r, _)| *r > rows).copied();
        let slope = match above {
            Some((ra, ca)) => (ca - below.1) / (ra - below.0) as f64,
            None if below.0 > 1 => (below.1 - 1.0) / (below.0 - 1) as f64,
            None => return below.1 + self.prior_cost(rows) - self.prior_cost(below.0),
        };
        below.1 + slope.max(0.0) * (rows - below.0) as f64
    }

    /// Drafter cost per token, relative to a one-row target forward: its seconds per draft
    /// token plus the probes' catch-up spread over the recent draft tokens; until measured, the
    /// prior ([`DraftLength::set_draft_cost_prior`], 0 without one).
    pub fn relative_draft_cost(&self) -> f64 {
        match (self.draft_token_s, self.forward_s.first().copied().flatten()) {
            (Some(d), Some(t1)) if t1 > 0.0 => (d + self.catch_up_per_token()) / t1,
            _ => self.draft_cost_prior,
        }
    }

    /// Assume the drafter costs `relative` one-row target forwards per draft token until its
    /// cost is measured (a draft model: [`SizeRatio::step`]). Without a prior an unmeasured
    /// drafter is free, which overrates a costly one before its first draft.
    pub fn set_draft_cost_prior(&mut self, relative: f64) {
        self.draft_cost_prior = relative.max(0.0);
    }

    /// Assume the drafter's catch-up costs `seconds` per context token until one is measured
    /// (a draft model: the target's prefill seconds per prompt token times
    /// [`SizeRatio::blocks`]). A measured cost, this request's or an earlier one's
    /// ([`DraftLength::warm_start`]), is kept.
    pub fn set_catch_up_prior(&mut self, seconds: f64) {
        if !self.catch_up_measured && seconds.is_finite() && seconds > 0.0 {
            self.catch_up_token_s = Some(seconds);
        }
    }

    /// Feed the seconds of a catch-up of `tokens` context tokens
    /// ([`super::Drafter::last_catch_up_s`]). Catch-ups shorter than [`MIN_CATCH_UP_SAMPLE`]
    /// are ignored; the first measurement replaces the prior, later ones are averaged in.
    pub fn observe_catch_up(&mut self, tokens: usize, seconds: f64) {
        if tokens < MIN_CATCH_UP_SAMPLE || !seconds.is_finite() || seconds <= 0.0 {
            return;
        }
        let per = seconds / tokens as f64;
        self.catch_up_token_s = Some(match self.catch_up_token_s {
            Some(m) if self.catch_up_measured => m + TIME_ALPHA * (per - m),
            _ => per,
        });
        self.catch_up_measured = true;
    }

    /// Whether a drafter that must first catch up on `catch_up_tokens` tokens of context
    /// (a draft model before its first draft: the prompt) should start now. The request has
    /// committed `committed` tokens without it at a cost of `spent` one-row target forwards,
    /// and has at most `remaining` tokens to go.
    ///
    /// This is the ski-rental problem (Karlin, Manasse, McGeoch and Owicki 1994): the
    /// catch-up costs `C` forwards once (its seconds per token, measured or prior, over a
    /// one-row forward); each later token saves `g = 1/s0 − 1/s1`, with `s0 = committed /
    /// spent` the speed-up so far without the drafter (n-gram lookup, or plain decoding) and
    /// `s1` the drafter's best predicted speed-up on the optimistic acceptance estimate. It
    /// starts once the tokens so far would have saved the catch-up (`committed·g ≥ C`), which
    /// costs at most twice what the best choice in hindsight costs whatever the answer's
    /// length, and never while the tokens left could not pay it back (`remaining·g < C`) or
    /// the drafter would not beat what runs without it (`g ≤ 0`). A short answer then never
    /// pays a catch-up that costs more than its whole decode saves; a long one pays a delay
    /// of about `C`. True when there is nothing to catch up on, k is fixed, or the catch-up's
    /// cost is unknown; false until a one-row forward has been timed.
    pub fn start_pays(&self, committed: usize, spent: f64, remaining: usize, catch_up_tokens: usize) -> bool {
        if !self.adaptive || catch_up_tokens == 0 {
            return true;
        }
        let Some(per) = self.catch_up_token_s else {
            return true;
        };
        let Some(t1) = self.forward_s[0].filter(|&t| t > 0.0) else {
            return false;
        };
        let c = catch_up_tokens as f64 * per / t1;
        let s0 = if committed > 0 && spent > 0.0 {
            committed as f64 / spent
        } else {
            1.0
        };
        let s1 = self.best_optimistic().1;
        if s1 <= 0.0 {
            return false;
        }
        let g = 1.0 / s0 - 1.0 / s1;
        g > 0.0 && committed as f64 * g >= c && remaining as f64 * g >= c
    }

    /// Probe catch-up seconds per recent draft token.
    fn catch_up_per_token(&self) -> f64 {
        if self.drafted > 0.0 {
            self.catch_up_s / self.drafted
        } else {
            0.0
        }
    }

    /// The longest pause between probes. A drafter whose probe costs more than a draft (a
    /// draft model re-seeds its cache first) probes less often.
    pub fn set_max_pause(&mut self, steps: usize) {
        self.max_pause = steps.max(1);
    }

    /// Price drafting per proposal ([`super::Drafter::priced_per_pass`]).
    pub fn set_priced_per_pass(&mut self) {
        self.per_pass = true;
    }

    /// Draft costs a draft of `drafted` tokens pays: one per token, or one per pass.
    fn draft_units(&self, drafted: usize) -> f64 {
        if self.per_pass {
            f64::from(u8::from(drafted > 0))
        } else {
            drafted as f64
        }
    }

    /// Decide the next steps under `load` (or alone, with None).
    pub fn set_load(&mut self, load: Option<Load>) {
        self.load = load;
    }

    /// Predicted speed-up over plain decoding of drafting `k` tokens per step. Alone:
    /// `E(k)·V(1) / (V(k+1) + k·D)`. Under a [`Load`]: `E(k)·c / (c + k·(b + D))`, with `c` plain
    /// decoding's seconds per token at this concurrency and `b` the marginal seconds of a row.
    pub fn predicted_speedup(&self, k: usize) -> f64 {
        self.speedup(self.expected_tokens(k), k, k)
    }

    /// The predicted speed-up of a plain decoding step (no draft), alone or under the
    /// [`Load`], in the units of [`DraftLength::predicted_speedup`].
    pub fn plain_speedup(&self) -> f64 {
        self.speedup(1.0, 0, 0)
    }

    /// The prefix (at least one token) of a draft with conditional acceptance estimates
    /// `alphas` whose step predicts the highest speed-up, and that speed-up, when the draft
    /// cost nothing to make (n-gram lookup: only its verify rows are paid); `(0, f64::MIN)` for
    /// no estimates.
    pub fn best_free_prefix(&self, alphas: &[f64]) -> (usize, f64) {
        self.best_prefix(alphas, 0)
    }

    /// The prefix (at least one token) of a draft with conditional acceptance estimates `alphas`
    /// and `drafted` tokens already paid for whose verify predicts the highest speed-up, and
    /// that speed-up; `(0, f64::MIN)` for no estimates.
    fn best_prefix(&self, alphas: &[f64], drafted: usize) -> (usize, f64) {
        let (mut reach, mut expected) = (1.0, 1.0);
        let mut best = (0, f64::MIN);
        for (m, a) in alphas.iter().enumerate() {
            reach *= a;
            expected += reach;
            let s = self.speedup(expected, m + 1, drafted);
            if s > best.1 {
                best = (m + 1, s);
            }
        }
        best
    }

    /// The speed-up of a step that commits `expected` tokens on average, verifies `rows` draft
    /// tokens and drafted `drafted` (all in units of plain decoding, as in
    /// [`DraftLength::predicted_speedup`]).
    fn speedup(&self, expected: f64, rows: usize, drafted: usize) -> f64 {
        let units = self.draft_units(drafted);
        if let Some(l) = self.load {
            let d = self.draft_cost_per_token();
            return expected * l.token_s / (l.token_s + rows as f64 * l.row_s + units * d);
        }
        let cost = self.relative_forward_cost(rows + 1) + units * self.relative_draft_cost();
        expected / cost
    }

    /// Whether the drafter reports confidences ([`super::Proposal::confidence`]) and they have
    /// been seen: then the draft's length follows them ([`DraftLength::go_on`],
    /// [`DraftLength::cut`]) up to `draft_max`.
    pub fn confidence_driven(&self) -> bool {
        self.adaptive && self.calibration.seen
    }

    /// The conditional acceptance estimates of a draft whose tokens have these confidences
    /// (index j: the (j+1)-th token is accepted given the ones before it were), from the
    /// learned calibration.
    pub fn calibrated(&self, confidence: &[f32]) -> Vec<f64> {
        confidence
            .iter()
            .enumerate()
            .map(|(j, &c)| self.calibration.estimate(j, c))
            .collect()
    }

    /// While drafting token by token: whether one more token is worth drafting after the
    /// tokens with these confidences. It is when the step's predicted speed-up with it
    /// (its acceptance taken as the position's average, `α_{j+1}`, and its draft cost paid)
    /// beats the speed-up without it.
    pub fn go_on(&self, confidence: &[f32]) -> bool {
        if !self.adaptive {
            return true;
        }
        let n = confidence.len();
        if n >= self.max {
            return false;
        }
        let mut reach = 1.0;
        let mut expected = 1.0;
        for a in self.calibrated(confidence) {
            reach *= a;
            expected += reach;
        }
        let next = self.alphas(n + 1)[n];
        self.speedup(expected + reach * next, n + 1, n + 1) > self.speedup(expected, n, n)
    }

    /// How many tokens of a drafted proposal with these confidences to verify: the prefix
    /// whose expected committed tokens per unit of time is highest, the drafting itself being
    /// paid already. 0 drops the draft (a plain decoding step). A fixed k keeps everything.
    pub fn cut(&self, confidence: &[f32]) -> usize {
        let n = confidence.len();
        if !self.adaptive || n == 0 {
            return n;
        }
        // The best prefix, or none when verifying nothing predicts more.
        let (m, s) = self.best_prefix(&self.calibrated(confidence), n);
        let best = if s > self.speedup(1.0, 0, n) { m } else { 0 };
        // A cut to nothing on a stale 2-row timing would keep it stale: verify one token,
        // which re-measures it (alone only: under load the batch's costs decide).
        if best == 0 && self.load.is_none() && self.timing_stale(2) && self.forward_s[0].is_some() {
            return 1;
        }
        best
    }

    /// How many tokens of `proposal` to verify: [`DraftLength::cut`] by its confidences when
    /// the drafts are deterministic (greedy: the target decides every committed token, so any
    /// cut is exact), all of them when they were sampled. Rejection sampling commits p's law
    /// only if each verified draft `d_j` is distributed as its `q_j`; keeping a sampled `d_j`
    /// because `q_j(d_j)` is high draws it from `q_j` restricted to the confident tokens
    /// instead (`tests/slaw.rs`, `a_confidence_cut_of_sampled_drafts_would_bias_the_law`).
    /// Whether a sampled draft is drafted at all may depend on the drafts before it
    /// ([`DraftLength::go_on`]): those are committed whenever it is reached.
    pub fn verified_prefix(&self, proposal: &super::Proposal) -> usize {
        match (&proposal.confidence, &proposal.q) {
            (Some(c), None) if self.confidence_driven() => self.cut(c).min(proposal.len()),
            _ => proposal.len(),
        }
    }

    /// Feed the confidences of a verified draft and how many of its tokens were accepted.
    pub fn observe_confidence(&mut self, confidence: &[f32], accepted: usize) {
        self.calibration.update(confidence, accepted);
    }

    /// Seconds a drafted token costs the drafter: its own time (until measured, the prior at
    /// the one-row forward's timing) plus the probes' catch-up.
    fn draft_cost_per_token(&self) -> f64 {
        let own = self
            .draft_token_s
            .or_else(|| self.forward_s[0].map(|t1| self.draft_cost_prior * t1))
            .unwrap_or(0.0);
        own + self.catch_up_per_token()
    }

    /// Under a [`Load`], whether drafting would lose even if every draft were accepted
    /// (`(k + 1)·c / (c + k·(b + D)) < 1` for every k): then a probe, which only measures
    /// acceptance, cannot change the decision.
    pub fn hopeless_under_load(&self) -> bool {
        let Some(l) = self.load else {
            return false;
        };
        let d = self.draft_cost_per_token();
        (1..=self.max).all(|k| (k + 1) as f64 * l.token_s < l.token_s + k as f64 * l.row_s + self.draft_units(k) * d)
    }

    /// The best k and its predicted speed-up.
    pub fn best(&self) -> (usize, f64) {
        self.best_with(false, self.max)
    }

    /// [`DraftLength::best`] among k ≤ `up_to` (`(1, f64::MIN)` when `up_to` is 0).
    pub fn best_up_to(&self, up_to: usize) -> (usize, f64) {
        self.best_with(false, up_to.min(self.max))
    }

    /// The best k and its predicted speed-up on the optimistic acceptance estimate
    /// ([`DraftLength::alphas_with`]): what pausing is decided on.
    fn best_optimistic(&self) -> (usize, f64) {
        self.best_with(true, self.max)
    }

    fn best_with(&self, optimistic: bool, up_to: usize) -> (usize, f64) {
        (1..=up_to)
            .map(|k| (k, self.speedup(self.expected_tokens_with(k, optimistic), k, k)))
            .fold((1, f64::MIN), |b, c| if c.1 > b.1 { c } else { b })
    }

    /// The k for the next step (0 = do not draft this step).
    pub fn next_k(&mut self) -> usize {
        self.measuring = false;
        if !self.adaptive {
            return self.max;
        }
        if self.pause > 0 {
            self.pause -= 1;
            if self.pause == 0 {
                // The pause is over: probe once, whatever the (stale) estimate says.
                self.probing = true;
            }
            return 0;
        }
        // Every cost is relative to a one-row forward, which a sequence that always drafts never
        // runs: measure one (a step without drafts) before the first decision on measured
        // multi-row costs, and again every RECALIBRATE_EVERY drafting steps.
        // A warm start's one-row timing is another request's, at another context length: it
        // counts as unmeasured until this request measures it.
        let multi_row_measured = self.forward_fed.iter().skip(1).any(Option::is_some);
        self.measuring =
            multi_row_measured && (self.forward_fed[0].is_none() || self.since_one_row >= RECALIBRATE_EVERY);
        if self.measuring {
            self.since_one_row = 0;
            return 0;
        }
        let (best_k, _) = self.best();
        let gain = self.best_optimistic().1;
        // A drafter with calibrated confidences decides its own length up to draft_max.
        let k = if self.calibration.seen { self.max } else { best_k };
        if self.probing && self.hopeless_under_load() {
            // A probe measures acceptance, and under this load no acceptance would pay: skip it.
            self.probing = false;
            self.pause = self.backoff;
            self.backoff = (self.backoff * 2).min(self.max_pause);
            return 0;
        }
        if self.probing {
            self.since_one_row += 1;
            return k;
        }
        if gain < 1.0 {
            self.pause = self.backoff;
            self.backoff = (self.backoff * 2).min(self.max_pause);
            return 0;
        }
        self.since_one_row += 1;
        k
    }

    /// Whether the next draft is a probe: the first after a pause, drafted whatever the
    /// (stale) estimate says.
    pub fn probing(&self) -> bool {
        self.probing
    }

    /// Whether the last [`DraftLength::next_k`] returned 0 to measure a one-row forward (the
    /// unit every cost is relative to), not to pause: such a step must run undrafted, by any
    /// drafter.
    pub fn measuring_one_row(&self) -> bool {
        self.measuring
    }

    /// The batch's draft budget ([`draft_budget`]) dropped this step's whole draft: the batch
    /// had cheaper ways to spend the rows. A drafter with a real cost (a draft model: more than
    /// [`COSTLY_DRAFT`] of a plain decoding token per draft token) backs off as after a probe
    /// that did not pay, so it does not keep drafting for nothing; the acceptance estimate is
    /// unchanged (nothing was verified). A free drafter (n-gram lookup) keeps proposing, so
    /// the budget can take its drafts whenever the batch makes room.
    pub fn note_trimmed(&mut self) {
        let unit = self.load.map(|l| l.token_s).or(self.forward_s[0]);
        let costly = unit.is_some_and(|u| self.draft_cost_per_token() > COSTLY_DRAFT * u);
        if !self.adaptive || !costly {
            return;
        }
        self.probing = false;
        self.pause = self.backoff;
        self.backoff = (self.backoff * 2).min(self.max_pause);
    }

    /// Feed the outcome of a step that verified `drafted` draft tokens, `accepted` of them.
    pub fn update(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        let tested = accepted + usize::from(accepted < drafted);
        for j in 0..self.max {
            if j < tested {
                self.accepted[j] = ACCEPT_DECAY * self.accepted[j] + f64::from(u8::from(j < accepted));
                self.tested[j] = ACCEPT_DECAY * self.tested[j] + 1.0;
            } else {
                self.accepted[j] *= UNTESTED_DECAY;
                self.tested[j] *= UNTESTED_DECAY;
            }
        }
        if self.probing {
            self.probing = false;
            // A probe ends the pause only if drafting now pays by the measured costs (accepted
            // drafts alone do not: they may still cost more than they save).
            if self.best_optimistic().1 >= 1.0 {
                self.backoff = 1;
            } else {
                self.pause = self.backoff;
                self.backoff = (self.backoff * 2).min(self.max_pause);
            }
        }
    }

    /// Feed the seconds of an r-row target forward. A multi-row count whose estimate is stale
    /// ([`DraftLength::timing_stale`]), or any count this request has not fed yet (a warm
    /// start's), takes the new timing as it is; otherwise it is averaged in. The one-row
    /// timing, the unit of every cost, is re-measured on a schedule (`RECALIBRATE_EVERY`) and
    /// always averaged, so one noisy step does not move every relative cost at once.
    pub fn observe_forward(&mut self, rows: usize, seconds: f64) {
        self.forwards += 1;
        if rows == 0 || rows > self.forward_s.len() {
            return;
        }
        let replace = if rows == 1 {
            self.forward_fed[0].is_none()
        } else {
            self.timing_stale(rows)
        };
        let e = &mut self.forward_s[rows - 1];
        *e = Some(match *e {
            Some(m) if !replace => m + TIME_ALPHA * (seconds - m),
            _ => seconds,
        });
        self.forward_fed[rows - 1] = Some(self.forwards);
    }

    /// Whether the timing of an r-row forward is unknown or stale: not fed by this request, or
    /// not in its last [`STALE_FORWARDS`] forwards. A forward's cost moves with the context
    /// length (at 1,570 positions SmolLM2's one-row step costs twice a short prompt's), and a
    /// row count the controller has stopped choosing is never re-measured: a 2-row timing taken
    /// once, slow, right after a long prompt's prefill kept a 2-row verify at 1.3-1.8 one-row
    /// steps in the controller's eyes (1.0-1.1 measured with k fixed), so it cut or paused
    /// every draft on the long_context prompts (docs/perf.md).
    pub fn timing_stale(&self, rows: usize) -> bool {
        let fed = self.forward_fed.get(rows.wrapping_sub(1)).copied().flatten();
        fed.is_none_or(|f| self.forwards.saturating_sub(f) >= STALE_FORWARDS)
    }

    /// Feed the seconds the drafter took to propose `tokens` tokens, `catch_up` of which it spent
    /// feeding context it had not seen (see [`super::Drafter::last_catch_up_s`]). The catch-up
    /// of a probe (the step after a pause) is priced over the recent draft tokens; a catch-up at
    /// any other step (the prompt, before the first draft) is not a cost of pausing.
    pub fn observe_draft(&mut self, tokens: usize, seconds: f64, catch_up: f64) {
        if tokens == 0 {
            return;
        }
        let catch_up = catch_up.clamp(0.0, seconds);
        self.catch_up_s = CATCH_UP_DECAY * self.catch_up_s + if self.probing { catch_up } else { 0.0 };
        let units = self.draft_units(tokens);
        self.drafted = CATCH_UP_DECAY * self.drafted + units;
        let per = (seconds - catch_up) / units;
        self.draft_token_s = Some(self.draft_token_s.map_or(per, |m| m + TIME_ALPHA * (per - m)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A controller with measured costs: verify of r rows = 1 + slope·(r-1), drafting `d` per token.
    fn measured(max: usize, slope: f64, d: f64) -> DraftLength {
        let mut c = DraftLength::new(max, true);
        for r in 1..=max + 1 {
            c.observe_forward(r, 0.01 * (1.0 + slope * (r - 1) as f64));
        }
        c.observe_draft(1, 0.01 * d, 0.0);
        c
    }

    #[test]
    fn batch_cost_fits_a_line() {
        let mut bc = BatchCost::default();
        assert_eq!(bc.load(4), None);
        for i in 0..40 {
            let r = 4 + (i % 5) * 4;
            bc.observe(r, 0.010 + 0.002 * r as f64);
        }
        let (a, b) = bc.fit().unwrap();
        assert!((a - 0.010).abs() < 1e-9 && (b - 0.002).abs() < 1e-9, "{a} {b}");
        let l = bc.load(16).unwrap();
        assert!((l.row_s - 0.002).abs() < 1e-9);
        assert!((l.token_s - (0.010 + 0.032) / 16.0).abs() < 1e-9);
        assert_eq!(bc.load(1), None, "alone: the solo timings decide");
        // Constant row counts leave the slope undetermined; the last fit stands.
        let mut flat = BatchCost::default();
        for _ in 0..40 {
            flat.observe(16, 0.04);
        }
        assert_eq!(flat.fit(), None);
        assert_eq!(flat.load(16), None);
        for _ in 0..200 {
            bc.observe(16, 0.042);
        }
        assert_eq!(bc.fit(), None);
        assert!((bc.load(16).unwrap().row_s - 0.002).abs() < 1e-9);
    }

    /// A cost curve with a row-group boundary: `12 + 0.8·R` ms, plus 3 ms past 16 rows (the
    /// Qwen 0.5B's shape), every row count 1..=48 measured.
    fn stepped_cost() -> BatchCost {
        let mut bc = BatchCost::default();
        for _ in 0..MEASURED_MIN {
            for r in 1..=48 {
                bc.observe(r, 1e-3 * (12.0 + 0.8 * r as f64 + if r > 16 { 3.0 } else { 0.0 }));
            }
        }
        bc
    }

    fn draft(len: usize, alpha: f64) -> PendingDraft {
        PendingDraft {
            len,
            alphas: vec![alpha],
            trimmable: true,
        }
    }

    #[test]
    fn the_batch_pays_a_row_group_boundary_once() {
        let bc = stepped_cost();
        assert!((bc.time(17).unwrap() - 0.0286).abs() < 1e-9);
        // The slope the per-sequence controllers see is the fit's, not the boundary's step.
        let l = bc.load(16).unwrap();
        let (_, b) = bc.fit().unwrap();
        assert!((l.row_s - b).abs() < 1e-15 && (l.token_s - 0.0248 / 16.0).abs() < 1e-12);
        // 16 streams, one of them drafting a likely token: the 17th row costs 3.8 ms for
        // 0.9 expected tokens, while a token of plain decoding costs 1.55 ms. Trimmed.
        let mut drafts = vec![draft(0, 0.6); 16];
        drafts[3] = draft(1, 0.9);
        assert_eq!(draft_budget(16, 16, &drafts, &bc)[3], 0);
        // Every stream drafting two tokens at acceptance 0.8: 48 rows commit 39 tokens
        // in 53.4 ms (0.73 per ms) against 16 in 24.8 (0.65). All kept.
        let drafts = vec![draft(2, 0.8); 16];
        assert_eq!(draft_budget(16, 16, &drafts, &bc), vec![2; 16]);
        // Below the boundary rows are cheap: 8 streams, one drafting two tokens at 0.7, kept.
        let mut drafts = vec![draft(0, 0.6); 8];
        drafts[5] = draft(2, 0.7);
        assert_eq!(draft_budget(8, 8, &drafts, &bc)[5], 2);
    }

    /// Plain decoding at 32 and 64 rows as the Qwen 0.5B ran it on two cores (368 and 330
    /// tok/s: the curve bends up), the fit from prefill chunks of 256 and 512 rows at a lower
    /// slope, and `t64` the 64-row forward's seconds.
    fn bent_cost(t64: f64) -> BatchCost {
        let mut bc = BatchCost::default();
        for _ in 0..4 {
            bc.observe(256, 0.400);
            bc.observe(512, 0.760);
        }
        for _ in 0..MEASURED_MIN {
            bc.observe(32, 32.0 / 368.0);
            bc.observe(64, t64);
        }
        bc
    }

    #[test]
    fn rows_past_a_bent_curve_cost_its_own_slope() {
        let bc = bent_cost(64.0 / 330.0);
        let (_, b) = bc.fit().unwrap();
        let token_s = 64.0 / 330.0 / 64.0;
        let secant = (64.0 / 330.0 - 32.0 / 368.0) / 32.0;
        // The premise: priced at the fit's slope, a draft accepted 88% of the time looked
        // worth its row (0.88 tokens at 3.03 ms a token against 1.34 ms a row) ...
        assert!(0.88 * token_s > b && secant > token_s, "{b} {token_s} {secant}");
        // ... but the measured curve's 65th row costs 3.35 ms, more than plain decoding's
        // token: nothing drafted at 64 streams pays, and the sequences see that slope.
        assert!((bc.time(65).unwrap() - (64.0 / 330.0 + secant)).abs() < 1e-12);
        assert!((bc.load(64).unwrap().row_s - secant).abs() < 1e-12);
        let mut drafts = vec![draft(0, 0.5); 64];
        drafts[..8].fill(draft(2, 0.88));
        assert_eq!(draft_budget(64, 64, &drafts, &bc)[..9], [0; 9]);
        // Where the curve does not bend (64 rows in 1.5× the time of 32: 1.36 ms a row past
        // 64 against 2.04 ms a token), the same drafts are kept.
        let bc = bent_cost(1.5 * 32.0 / 368.0);
        assert!(bc.load(64).unwrap().row_s < 0.0018);
        assert_eq!(draft_budget(64, 64, &drafts, &bc)[..9], [2, 2, 2, 2, 2, 2, 2, 2, 0]);
    }

    #[test]
    fn rows_past_the_last_measured_count_cost_the_slope_from_there() {
        // Plain decoding at 16 rows, a few steps at 17 (past a boundary), the fit from prefill
        // chunks of 64 and 128 rows.
        let mut bc = BatchCost::default();
        for _ in 0..4 {
            bc.observe(64, 0.060);
            bc.observe(128, 0.110);
        }
        for _ in 0..MEASURED_MIN {
            bc.observe(16, 0.0248);
            bc.observe(17, 0.0286);
        }
        let (a, b) = bc.fit().unwrap();
        assert!((bc.time(16).unwrap() - 0.0248).abs() < 1e-12);
        assert!((bc.time(19).unwrap() - (0.0286 + 2.0 * b)).abs() < 1e-12);
        assert!((bc.time(8).unwrap() - (a + 8.0 * b)).abs() < 1e-12);
        assert!((b - 0.00078).abs() < 1e-4, "{b}");
        // One stream of 16 drafting two sure tokens: 17.97 tokens in 29.4 ms (the 18th row
        // at the slope past the measured 17th) against 16 in 24.8 ms. Trimmed.
        let mut drafts = vec![draft(0, 0.5); 16];
        drafts[0] = draft(2, 0.99);
        assert_eq!(draft_budget(16, 16, &drafts, &bc)[0], 0);
        // Four of them: 23.9 tokens in 34.1 ms, the boundary shared. Kept.
        drafts[1..4].fill(draft(2, 0.99));
        assert_eq!(draft_budget(16, 16, &drafts, &bc)[..5], [2, 2, 2, 2, 0]);
        // With no fit, nothing past the measured row counts is assumed free.
        let mut only = BatchCost::default();
        for _ in 0..8 {
            only.observe(16, 0.0248);
        }
        assert!(only.time(17).is_none());
        assert_eq!(draft_budget(16, 16, &drafts, &only)[..2], [0, 0]);
    }

    #[test]
    fn the_draft_budget_keeps_the_likely_tokens_and_fixed_drafts() {
        let bc = stepped_cost();
        // At 8 rows (0.44 tokens per ms), a row at 0.8 ms pays for a token worth > 0.35.
        let drafts = [
            draft(4, 0.9),
            draft(4, 0.1),
            PendingDraft {
                len: 3,
                alphas: vec![0.1],
                trimmable: false,
            },
            draft(4, 0.55),
        ];
        // 0.9^1..4 all pay, 0.55 and 0.55^2 = 0.30: the first only; 0.1: none.
        assert_eq!(draft_budget(8, 8, &drafts, &bc), vec![4, 0, 3, 1]);
        // Without a cost estimate nothing is trimmed.
        assert_eq!(draft_budget(8, 8, &drafts, &BatchCost::default()), vec![4, 4, 3, 4]);
        // Nothing to decide.
        assert_eq!(draft_budget(8, 8, &[], &bc), Vec::<usize>::new());
        // A noisy low measurement past the boundary does not make those rows look cheaper
        // than the rows before them.
        let mut bc = stepped_cost();
        for _ in 0..8 {
            bc.observe(20, 0.001);
        }
        let mut drafts = vec![draft(0, 0.6); 16];
        drafts[0] = draft(4, 0.9);
        assert_eq!(draft_budget(16, 16, &drafts, &bc)[0], 0);
    }

    #[test]
    fn under_load_drafting_stops_where_rows_are_dear() {
        // Solo, acceptance 0.5 at every position and a cheap verify: drafting pays.
        let mut c = measured(4, 0.1, 0.0);
        feed(&mut c, 2, &[0.5, 0.5], 40);
        assert!((c.alpha() - 0.5).abs() < 0.1, "{}", c.alpha());
        assert!(c.best().1 > 1.0);
        // 16 sequences on a CPU: a row costs 0.3 of a one-row forward, plain decoding 0.38 per
        // token (the measured SmolLM2 shape): k = 1 would commit 1.5 tokens for 1.8x the time.
        c.set_load(Some(Load {
            row_s: 0.003,
            token_s: 0.0038,
        }));
        assert!(c.best().1 < 1.0, "{:?}", c.best());
        assert_eq!(c.next_k(), 0);
        // A GPU-like load (rows nearly free): drafting pays again.
        c.set_load(Some(Load {
            row_s: 0.0001,
            token_s: 0.0038,
        }));
        assert!(c.best().1 > 1.0);
    }

    /// Feed `steps` drafting steps of `k` tokens whose outcomes follow the conditional
    /// acceptance rates `alphas` exactly in proportion (a deterministic pattern: of every 100
    /// steps, the first `100·α_1` accept the first token, and so on).
    fn feed(c: &mut DraftLength, k: usize, alphas: &[f64], steps: usize) {
        for s in 0..steps {
            let u = ((s * 37) % 100) as f64 / 100.0;
            let mut reach = 1.0;
            let mut accepted = 0;
            for &a in alphas.iter().take(k) {
                reach *= a;
                if u >= reach {
                    break;
                }
                accepted += 1;
            }
            c.update(k, accepted);
        }
    }

    #[test]
    fn acceptance_is_estimated_per_draft_position() {
        // A chained MTP head: the second draft is accepted at 0.3 once the first was, the
        // third at 0.1 (SmolLM2's head on prose). One pooled α (0.40 here) would overrate
        // the later drafts when measured at k = 1 and underrate the first at k = 3.
        let mut c = measured(3, 0.15, 0.12);
        feed(&mut c, 3, &[0.5, 0.3, 0.1], 200);
        let a = c.alphas(3);
        assert!(
            (a[0] - 0.5).abs() < 0.1 && (a[1] - 0.3).abs() < 0.12 && a[2] < 0.25,
            "{a:?}"
        );
        // E(1) = 1.5 for 1.27 steps, E(2) = 1.65 for 1.54: k = 1.
        assert_eq!(c.best().0, 1, "{:?} {:?}", c.best(), a);
        assert!(c.best().1 > 1.1, "{:?}", c.best());
        // n-gram lookup on a copy: a match's first token is a coin flip, its continuation
        // nearly sure. The long draft pays where a geometric law at 0.5 would say k = 1..2.
        let mut c = measured(8, 0.05, 0.0);
        feed(&mut c, 8, &[0.5, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95], 200);
        assert!(c.expected_tokens(8) > 3.5, "{}", c.expected_tokens(8));
        assert_eq!(c.best().0, 8, "{:?} {:?}", c.best(), c.alphas(8));
        // A position not tested lately relaxes towards the one before it: after a long run
        // of one-token drafts the second position is worth trying again.
        let mut c = DraftLength::new(2, true);
        feed(&mut c, 2, &[0.9, 0.1], 100);
        let before = c.alphas(2)[1];
        feed(&mut c, 1, &[0.9], 150);
        let after = c.alphas(2)[1];
        assert!(before < 0.3 && after > 0.6, "{before} -> {after}");
    }

    #[test]
    fn confidence_is_calibrated_and_cuts_drafts() {
        // Verify rows cost 0.1 of a step each, a draft token 0.05.
        let mut c = measured(6, 0.1, 0.05);
        assert!(!c.confidence_driven());
        // Until observed, a confidence is taken at its word.
        assert!((c.calibrated(&[0.7])[0] - 0.7).abs() < 1e-6);
        // A head that is overconfident in the 0.5 bucket (accepted a fifth of the time) and
        // right in the 0.9 bucket.
        for i in 0..200 {
            c.observe_confidence(&[0.95], 1);
            c.observe_confidence(&[0.55], usize::from(i % 5 == 0));
        }
        assert!(c.confidence_driven());
        let a = c.calibrated(&[0.95, 0.55]);
        assert!(a[0] > 0.9, "{a:?}");
        // The second entry is the second position's group: not observed yet, so raw.
        assert!((a[1] - 0.55).abs() < 1e-6, "{a:?}");
        let first = c.calibrated(&[0.55])[0];
        assert!((first - 0.2).abs() < 0.05, "{first}");
        // Cut: two sure tokens, then one the calibration says fails, then a sure one that can
        // only count if the failing one passes.
        assert_eq!(c.cut(&[0.95, 0.95, 0.05, 0.95]), 2);
        assert_eq!(c.cut(&[0.95, 0.95, 0.95]), 3);
        // A first token that will likely fail: no draft is worth its row.
        for _ in 0..200 {
            c.observe_confidence(&[0.05], 0);
        }
        assert_eq!(c.cut(&[0.05, 0.95]), 0);
        // While drafting: go on after sure tokens, stop after a doubtful one, stop at draft_max.
        c.update(3, 3);
        assert!(c.go_on(&[0.95]));
        assert!(c.go_on(&[0.95, 0.95]));
        assert!(!c.go_on(&[0.95, 0.05]));
        assert!(!c.go_on(&[0.95; 6]));
        // A fixed k ignores confidences.
        let f = DraftLength::new(4, false);
        assert_eq!(f.cut(&[0.01, 0.01]), 2);
        assert!(f.go_on(&[0.01]));
    }

    #[test]
    fn a_stale_verify_timing_is_measured_again() {
        // Every r-row forward measured once: a 2-row verify at 1.8 one-row steps (taken slow,
        // as right after a long prompt's prefill), a draft token at 0.05; first drafts of
        // confidence 0.35 accepted 30% of the time.
        let mut c = measured(4, 0.8, 0.05);
        for i in 0..200 {
            c.observe_confidence(&[0.35], usize::from(i % 10 < 3));
        }
        // Fresh: such a draft is not worth a 1.8-step verify.
        assert!(!c.timing_stale(2));
        assert_eq!(c.cut(&[0.35]), 0);
        // STALE_FORWARDS one-row forwards later the 2-row timing is stale: one draft token is
        // verified, which measures it again ...
        for _ in 0..STALE_FORWARDS {
            c.observe_forward(1, 0.01);
        }
        assert!(c.timing_stale(2) && !c.timing_stale(1));
        assert_eq!(c.cut(&[0.35]), 1);
        // ... and the new timing replaces the stale one (averaged, it would move a quarter of
        // the way, to 1.61); at 1.05 steps the same draft pays.
        c.observe_forward(2, 0.0105);
        assert!((c.relative_forward_cost(2) - 1.05).abs() < 1e-9);
        assert!(!c.timing_stale(2));
        assert_eq!(c.cut(&[0.35]), 1);
        // A fresh timing averages a new one in: one noisy step moves it a quarter of the way.
        c.observe_forward(2, 0.0205);
        assert!((c.relative_forward_cost(2) - 1.3).abs() < 1e-9);
        // Under load the batch's costs decide: no exploring cut.
        let mut l = c.clone();
        for _ in 0..STALE_FORWARDS {
            l.observe_forward(1, 0.01);
        }
        l.set_load(Some(Load {
            row_s: 0.02,
            token_s: 0.01,
        }));
        assert_eq!(l.cut(&[0.35]), 0);
        // A warm start's timings (another request's, at another context length) are replaced
        // by this request's first measurement of each row count.
        let mut w = DraftLength::new(4, true);
        w.warm_start(&c);
        assert!((w.relative_forward_cost(2) - 1.3).abs() < 1e-9);
        w.observe_forward(2, 0.012);
        assert!((w.relative_forward_cost(2) - 1.2).abs() < 1e-9);
    }

    #[test]
    fn high_acceptance_and_cheap_verify_draft_long() {
        let mut c = measured(8, 0.05, 0.0);
        for _ in 0..20 {
            c.update(8, 8);
        }
        assert!(c.alpha() > 0.9, "{}", c.alpha());
        assert_eq!(c.next_k(), 8);
    }

    #[test]
    fn expensive_drafts_shorten_k_and_bad_drafts_pause() {
        // The Qwen pair on a CPU: the draft model costs ~0.55 of a target step.
        let mut c = measured(8, 0.1, 0.55);
        for _ in 0..20 {
            c.update(4, 3);
            c.update(4, 4);
        }
        let (k, gain) = c.best();
        assert!((2..8).contains(&k), "k = {k}");
        assert!(gain > 1.0);
        // Drafts that fail: drafting stops, with growing pauses between probes.
        let mut c = measured(8, 0.3, 0.55);
        let mut pauses = Vec::new();
        for _ in 0..6 {
            let mut n = 0;
            while c.next_k() == 0 {
                n += 1;
            }
            c.update(2, 0);
            pauses.push(n);
        }
        assert!(pauses.windows(2).all(|w| w[1] >= w[0]), "{pauses:?}");
        assert!(*pauses.last().unwrap() >= 16, "{pauses:?}");
        // Probes that succeed raise the acceptance estimate until drafting pays again (here
        // that takes α_1 >= 0.85: each probe is one more observation of the first position);
        // then the back-off resets and drafting resumes.
        let mut resumed = false;
        for _ in 0..24 {
            while c.next_k() == 0 {}
            c.update(2, 2);
            if c.best().1 >= 1.0 {
                assert!(c.next_k() > 0, "drafting pays: no pause");
                resumed = true;
                break;
            }
        }
        assert!(resumed, "drafting resumed after successful probes");
    }

    #[test]
    fn probe_catch_ups_are_priced_over_recent_draft_tokens() {
        // One-row forward 10 ms; a draft token 4 ms (0.4 of a step).
        let mut c = measured(4, 0.3, 0.4);
        assert!((c.relative_draft_cost() - 0.4).abs() < 1e-9);
        // A catch-up outside a probe (the prompt, before the first draft) is not priced.
        c.observe_draft(1, 0.004 + 0.050, 0.050);
        assert!(
            (c.relative_draft_cost() - 0.4).abs() < 1e-9,
            "{}",
            c.relative_draft_cost()
        );
        // Acceptance where drafting one token just pays without catch-ups: 1.75 / (1.3 + 0.4).
        for _ in 0..30 {
            c.update(1, 0);
            c.update(1, 1);
            c.update(1, 1);
            c.update(1, 1);
        }
        assert!(c.predicted_speedup(1) > 0.99, "{}", c.predicted_speedup(1));
        // Then drafting below break-even: one draft in two is rejected (1.5 / 1.7), so even the
        // optimistic estimate falls below 1 and a pause follows; each probe then feeds what the
        // pause left unseen (10 ms of catch-up, one target step). Priced over the recent draft
        // tokens, the catch-ups make drafting pay even less, and the pauses grow instead of
        // resetting.
        let mut pauses = Vec::new();
        let mut n = 0;
        for step in 0..400 {
            let k = c.next_k();
            if k == 0 {
                n += 1;
                continue;
            }
            let catch_up = if n > 0 { 0.010 } else { 0.0 };
            if n > 0 {
                pauses.push(n);
                n = 0;
            }
            c.observe_draft(k, 0.004 * k as f64 + catch_up, catch_up);
            c.update(k, usize::from(step % 2 != 0).min(k));
        }
        assert!(c.relative_draft_cost() > 0.45, "{}", c.relative_draft_cost());
        assert!(pauses.len() >= 3 && *pauses.last().unwrap() >= 32, "{pauses:?}");
    }

    /// A cheap drafter (a 2-row verify at 1.05 steps, a draft token at 0.13: break-even near
    /// acceptance 0.18) whose first drafts fail, as SmolLM2's MTP head on a long prompt
    /// (1 of its first 8 accepted, 0.38 over the whole answer): when the plain estimate first
    /// says pause, the optimistic one still drafts. Firm evidence of failure still pauses.
    #[test]
    fn early_rejections_of_a_cheap_drafter_do_not_pause_it() {
        let mut c = measured(1, 0.05, 0.13);
        let mut rejected = 0;
        while c.best().1 >= 1.0 {
            c.update(1, 0);
            rejected += 1;
            assert!(rejected < 50, "{:?}", c.best());
        }
        assert!(
            c.best_optimistic().1 >= 1.0,
            "after {rejected}: {:?}",
            c.best_optimistic()
        );
        assert_eq!(c.next_k(), 1, "keeps drafting after {rejected} rejections");
        // Many more rejections in a row: now it pauses.
        for _ in 0..40 {
            c.update(1, 0);
        }
        assert_eq!(c.next_k(), 0);
    }

    /// A block drafter pays its whole pass for any draft length: priced per token, a pass of 7
    /// tokens at 0.7 steps looks like 0.1 a token, and a draft cut to one token looks cheap
    /// enough to keep drafting at acceptance 0.1, where a step really costs 1.05 + 0.7 for 1.1
    /// tokens; priced per pass, the controller pauses.
    #[test]
    fn a_block_drafter_is_priced_per_pass() {
        let make = |per_pass: bool| {
            let mut c = DraftLength::new(7, true);
            if per_pass {
                c.set_priced_per_pass();
            }
            for r in 1..=8 {
                c.observe_forward(r, 0.01 * (1.0 + 0.05 * (r - 1) as f64));
            }
            c.observe_draft(7, 0.007, 0.0);
            for i in 0..60 {
                c.update(1, usize::from(i % 10 == 0));
            }
            c
        };
        let (tok, pass) = (make(false), make(true));
        assert!((tok.relative_draft_cost() - 0.1).abs() < 1e-9);
        assert!((pass.relative_draft_cost() - 0.7).abs() < 1e-9);
        assert!(tok.best_optimistic().1 >= 1.0, "{:?}", tok.best_optimistic());
        assert!(pass.best_optimistic().1 < 1.0, "{:?}", pass.best_optimistic());
        let mut pass = pass;
        assert_eq!(pass.next_k(), 0, "pauses");
    }

    #[test]
    fn unmeasured_row_counts_are_interpolated() {
        let mut c = DraftLength::new(8, true);
        c.observe_forward(1, 0.010);
        c.observe_forward(3, 0.012);
        c.observe_forward(9, 0.024);
        assert!((c.relative_forward_cost(2) - 1.1).abs() < 1e-9);
        assert!((c.relative_forward_cost(6) - 1.8).abs() < 1e-9);
        assert!((c.relative_forward_cost(9) - 2.4).abs() < 1e-9);
    }

    /// A sequence that always drafts never runs a one-row forward: the controller runs one to
    /// measure the unit of its costs, then pauses when drafting does not pay (the draft model of
    /// a 2-core CPU: drafts cost 0.6 of a target step, an r-row verify 0.6 r).
    #[test]
    fn costs_are_calibrated_with_a_one_row_step_then_bad_drafting_pauses() {
        let mut c = DraftLength::new(4, true);
        assert!(c.next_k() > 0, "optimistic start");
        for _ in 0..3 {
            c.observe_forward(5, 0.030);
            c.observe_draft(4, 0.024, 0.0);
            c.update(4, 3);
        }
        assert_eq!(c.next_k(), 0, "a one-row step to measure the unit");
        c.observe_forward(1, 0.010);
        let (_, gain) = c.best();
        assert!(gain < 1.0, "predicted {gain}");
        assert_eq!(c.next_k(), 0, "does not pay: pause");
        // Cheap drafts with the same acceptance pay again, and a re-measure comes every
        // RECALIBRATE_EVERY drafting steps.
        let mut c = DraftLength::new(4, true);
        c.observe_forward(1, 0.010);
        let mut ones = 0;
        for _ in 0..(3 * RECALIBRATE_EVERY) {
            let k = c.next_k();
            if k == 0 {
                ones += 1;
                c.observe_forward(1, 0.010);
            } else {
                c.observe_forward(k + 1, 0.010 * (1.0 + 0.2 * k as f64));
                c.observe_draft(k, 0.0001 * k as f64, 0.0);
                c.update(k, k);
            }
        }
        assert!(
            (2..=4).contains(&ones),
            "{ones} one-row steps in {} steps",
            3 * RECALIBRATE_EVERY
        );
    }

    #[test]
    fn a_prior_that_does_not_pay_starts_paused() {
        let mut prior = measured(4, 0.6, 0.6);
        for _ in 0..10 {
            prior.update(4, 2);
        }
        assert!(prior.best().1 < 1.0);
        let mut c = DraftLength::new(4, true);
        c.warm_start(&prior);
        assert!(
            (0..MAX_PAUSE).all(|_| c.next_k() == 0),
            "paused for the longest back-off"
        );
        assert!(c.next_k() > 0, "then one probe");
        let mut fixed = DraftLength::new(4, false);
        fixed.warm_start(&prior);
        assert_eq!(fixed.next_k(), 4);
    }

    #[test]
    fn a_costly_drafter_backs_off_when_the_batch_trims_it_and_a_free_one_does_not() {
        let load = Some(Load {
            row_s: 0.0009,
            token_s: 0.0015,
        });
        for (draft_s, backs_off) in [(0.0004, true), (0.000002, false)] {
            let mut c = measured(4, 0.05, 0.0);
            for _ in 0..10 {
                c.update(2, 2);
            }
            c.observe_draft(2, 2.0 * draft_s, 0.0);
            c.set_load(load);
            assert!(c.next_k() > 0, "draft_s {draft_s}: drafts pay at this acceptance");
            c.note_trimmed();
            c.note_trimmed();
            // Two trims: a pause of 1, then 2 steps.
            let ks: Vec<usize> = (0..3).map(|_| c.next_k()).collect();
            if backs_off {
                assert_eq!(ks[..2], [0, 0], "draft_s {draft_s}: {ks:?}");
            } else {
                assert!(ks.iter().all(|&k| k > 0), "draft_s {draft_s}: {ks:?}");
            }
        }
        // A fixed k is never paused.
        let mut f = DraftLength::new(3, false);
        f.note_trimmed();
        assert_eq!(f.next_k(), 3);
    }

    #[test]
    fn fixed_k_ignores_everything() {
        let mut c = DraftLength::new(3, false);
        c.update(3, 0);
        c.observe_forward(4, 100.0);
        assert_eq!(c.next_k(), 3);
    }

    #[test]
    fn a_draft_model_starts_once_its_catch_up_has_paid() {
        // Nothing to catch up on, a fixed k, or a catch-up of unknown cost: start at once.
        let mut c = DraftLength::new(4, true);
        assert!(c.start_pays(0, 0.0, 100, 0));
        assert!(c.start_pays(0, 0.0, 100, 40));
        assert!(DraftLength::new(4, false).start_pays(0, 0.0, 100, 40));
        // A draft token costs 0.3 of a one-row forward, a catch-up token 1 ms.
        c.set_draft_cost_prior(0.3);
        c.set_catch_up_prior(0.001);
        // No one-row forward timed yet: wait.
        assert!(!c.start_pays(0, 0.0, 100, 40));
        for r in 1..=5 {
            c.observe_forward(r, 0.01 * (1.0 + 0.1 * (r - 1) as f64));
        }
        // The catch-up of 40 tokens costs C = 40 ms / 10 ms = 4 one-row forwards. On the
        // optimistic prior (α = 0.625 + one standard error = 0.867 at every position) the
        // draft model's best step is k = 3: E = 3.271 tokens for 1.3 + 3·0.3 = 2.2 forwards,
        // s1 = 1.487. Without it (plain decoding, s0 = 1) each token would save
        // g = 1 - 1/1.487 = 0.327 forwards, so the catch-up pays after C/g = 12.2 tokens.
        let s1 = c.best_optimistic().1;
        assert!((s1 - 1.4867).abs() < 1e-3, "{s1}");
        assert!(!c.start_pays(12, 12.0, 100, 40));
        assert!(c.start_pays(13, 13.0, 100, 40));
        // Not when the tokens left cannot pay the catch-up back ...
        assert!(!c.start_pays(13, 13.0, 12, 40));
        // ... nor when what runs without it (n-gram lookup at s0 = 1.6) is faster than the
        // draft model's best.
        assert!(!c.start_pays(160, 100.0, 1000, 40));
        // A longer catch-up waits longer: 80 tokens pay after 24.5 tokens.
        assert!(!c.start_pays(24, 24.0, 100, 80));
        assert!(c.start_pays(25, 25.0, 100, 80));
        // Drafting measured at 0.6 forwards per token (the prior no longer counts): the best
        // step is now k = 1, s1 = 1.867 / 1.7 = 1.098, g = 0.089, 40 tokens pay after 45.
        c.observe_draft(1, 0.006, 0.0);
        assert!(!c.start_pays(44, 44.0, 1000, 40));
        assert!(c.start_pays(45, 45.0, 1000, 40));
    }

    #[test]
    fn catch_up_costs_are_measured_over_long_feeds_and_carried_to_the_next_request() {
        let mut c = DraftLength::new(4, true);
        c.set_catch_up_prior(0.002);
        // A feed of a few tokens costs about a draft step whatever its length: ignored.
        c.observe_catch_up(MIN_CATCH_UP_SAMPLE - 1, 0.1);
        assert_eq!(c.catch_up_token_s, Some(0.002));
        // The first measurement replaces the prior; a prior never replaces a measurement.
        c.observe_catch_up(40, 0.04);
        assert_eq!(c.catch_up_token_s, Some(0.001));
        c.set_catch_up_prior(0.005);
        assert_eq!(c.catch_up_token_s, Some(0.001));
        // Later ones are averaged in.
        c.observe_catch_up(20, 0.04);
        let averaged = 0.001 + TIME_ALPHA * 0.001;
        assert!((c.catch_up_token_s.unwrap() - averaged).abs() < 1e-15);
        // The next request starts from the measurement, and keeps it over its own prior.
        let mut w = DraftLength::new(4, true);
        w.warm_start(&c);
        w.set_catch_up_prior(0.005);
        assert!((w.catch_up_token_s.unwrap() - averaged).abs() < 1e-15);
        // An unmeasured prior is not carried.
        let mut p = DraftLength::new(4, true);
        p.set_catch_up_prior(0.003);
        let mut w = DraftLength::new(4, true);
        w.warm_start(&p);
        assert_eq!(w.catch_up_token_s, None);
    }

    #[test]
    fn moe_verify_prior_counts_the_experts_the_rows_touch() {
        // Qwen3-30B-A3B's shape: 48 layers of hidden 2048 (32 heads / 4 KV heads of 128), 128
        // experts of 768, 8 per token.
        let moe = crate::arch::MoeConfig {
            experts: 128,
            experts_per_token: 8,
            expert_intermediate_size: 768,
            shared_intermediate_size: None,
            norm_topk_prob: true,
            layers: vec![true; 48],
        };
        let mut c = ModelConfig {
            family: crate::model::Family::Other("qwen3moe"),
            vocab_size: 151_936,
            hidden_size: 2048,
            intermediate_size: 6144,
            num_layers: 48,
            num_heads: 32,
            num_kv_heads: 4,
            head_dim: 128,
            rms_norm_eps: 1e-6,
            rope_theta: 1e6,
            context_length: 32_768,
            rope_style: crate::model::RopeStyle::Neox,
            sliding_window: None,
            query_scale: None,
            rope_freq_scale: None,
            moe: Some(moe.clone()),
        };
        assert_eq!(verify_cost_prior(&c, 1), 1.0);
        // 9 rows touch 128 (1 - (120/128)^9) = 56.4 experts a layer instead of 8: 48.4 more
        // experts of 3 x 2048 x 768 weights in 48 layers, over a 3.04 B-weight step, plus the
        // arithmetic's 0.8.
        let p9 = verify_cost_prior(&c, 9);
        let want = 1.8
            + 48.0 * 3.0 * 2048.0 * 768.0 * 128.0 * ((1.0 - (120.0f64 / 128.0).powi(9)) - 8.0 / 128.0)
                / c.step_params() as f64;
        assert!((p9 - want).abs() < 1e-9 && (5.0..6.0).contains(&p9), "{p9} vs {want}");
        assert!(verify_cost_prior(&c, 3) < verify_cost_prior(&c, 5));
        c.moe = None;
        assert!(
            (verify_cost_prior(&c, 9) - 1.8).abs() < 1e-12,
            "dense: the arithmetic alone"
        );
        // The controller prices unmeasured rows by it.
        let mut k = DraftLength::new(8, true);
        c.moe = Some(moe);
        k.set_verify_prior((1..=9).map(|r| verify_cost_prior(&c, r)).collect());
        assert_eq!(k.relative_forward_cost(9), p9);
        k.observe_forward(1, 0.01);
        assert!(
            (k.relative_forward_cost(9) - p9).abs() < 1e-9,
            "one row measured: the prior's steps"
        );
    }

    #[test]
    fn size_ratios_count_the_weights_of_the_qwen_pair() {
        let qwen = |layers, hidden, intermediate, heads, head_dim| ModelConfig {
            family: crate::model::Family::Qwen2,
            vocab_size: 151_936,
            hidden_size: hidden,
            intermediate_size: intermediate,
            num_layers: layers,
            num_heads: heads,
            num_kv_heads: 2,
            head_dim,
            rms_norm_eps: 1e-6,
            rope_theta: 1e6,
            context_length: 32_768,
            rope_style: crate::model::RopeStyle::Neox,
            sliding_window: None,
            query_scale: None,
            rope_freq_scale: None,
            moe: None,
        };
        // Qwen2.5 0.5B and 1.5B: 24 layers of hidden 896 (14 heads of 64, MLP 4864) and 28
        // of hidden 1536 (12 heads of 128, MLP 8960), both with 2 KV heads.
        let draft = qwen(24, 896, 4864, 14, 64);
        let target = qwen(28, 1536, 8960, 12, 128);
        assert_eq!(
            draft.block_params(),
            24 * (2 * 896 * 896 + 2 * 896 * 128 + 3 * 896 * 4864)
        );
        assert_eq!(draft.block_params(), 357_826_560);
        assert_eq!(target.block_params(), 1_310_195_712);
        assert_eq!(target.step_params(), 1_310_195_712 + 151_936 * 1536);
        let r = SizeRatio::of(&draft, draft.vocab_size, &target);
        assert!((r.blocks - 0.27311).abs() < 1e-4, "{r:?}");
        assert!((r.step - 0.32001).abs() < 1e-4, "{r:?}");
        // A draft vocabulary of 32,768 tokens: (357,826,560 + 32,768 · 896) / 1,543,569,408.
        let r = SizeRatio::of(&draft, 32_768, &target);
        assert!((r.blocks - 0.27311).abs() < 1e-4, "{r:?}");
        assert!((r.step - 0.25084).abs() < 1e-4, "{r:?}");
    }
}
