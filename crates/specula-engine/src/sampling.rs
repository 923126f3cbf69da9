//! Logits processing and sampling.
//!
//! The pipeline, applied to one row of logits (`f32`, length = vocab size), in this order (the
//! order llama.cpp and vLLM use):
//! 1. the logit bias (OpenAI's `logit_bias`: `logit += bias`), then the penalties over the
//!    tokens generated so far (repetition: CTRL, Keskar et al. 2019 — divide a positive logit by
//!    the penalty, multiply a negative one; presence and frequency: OpenAI's definition,
//!    `logit -= presence * [count > 0] + frequency * count`): [`Sampler::process_logits`];
//! 2. greedy (temperature 0) takes the argmax (lowest id on ties) and stops here;
//! 3. temperature, then top-k, top-p (nucleus, Holtzman et al. 2019) and min-p filtering;
//! 4. softmax over the survivors and one draw ([`keyed_draw`]): the token whose exponential
//!    race time `E_v / p(v)` is least, with `E_v = -ln u_v` and `u_v` counter-based noise of the
//!    request's seed, the token's position in the sequence and its id ([`unit_noise`]).
//!
//! The draw is a function of (seed, position, distribution) alone, not of how many draws came
//! before. That is what makes seeded sampling drafter-invariant (Daliri, Musco, Suresh 2024,
//! "Coupling without Communication and Drafter-Invariant Speculative Decoding", Gumbel-max
//! coupling): the target's token at a position is the same whatever was drafted, so a seeded
//! request's output with speculation is byte-identical to plain decoding with that seed
//! ([`crate::speculative::SampledVerify::Coupled`]). `argmin E_v / p(v)` is the Gumbel-max trick in
//! the exponential form; it selects v with probability p(v).
//!
//! [`Sampler::distribution`] exposes the processed distribution as probabilities: speculative
//! verification needs exactly the `p` (and `q`) the sampler draws from.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;
use serde::{Deserialize, Serialize};

use crate::types::RequestError;

/// Sampling parameters of one request. Defaults are OpenAI's (temperature 1, no filtering).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 = greedy. Must be >= 0.
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 = disabled.
    pub top_k: usize,
    /// Nucleus mass in (0, 1]; 1 = disabled.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the top probability; 0 = disabled.
    pub min_p: f32,
    /// Multiplicative repetition penalty (CTRL); 1 = disabled. Must be > 0.
    pub repetition_penalty: f32,
    /// Additive presence penalty in [-2, 2]; 0 = disabled.
    pub presence_penalty: f32,
    /// Additive frequency penalty in [-2, 2]; 0 = disabled.
    pub frequency_penalty: f32,
    /// RNG seed; the same seed and request give the same output. `None` = a fresh random seed.
    pub seed: Option<u64>,
    /// `(token id, bias)` pairs, ids ascending and distinct, each bias in [-100, 100]: added to
    /// the token's logit before the penalties (OpenAI's `logit_bias`, applied in llama.cpp's
    /// sampler order). -100 in practice bans a token, 100 selects it. Empty = none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Greedy decoding (temperature 0).
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Is this greedy (temperature 0)?
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Whether repetition, presence or frequency penalties change the logits.
    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }

    /// Whether [`Sampler::process_logits`] changes a row: a logit bias or penalties.
    pub fn transforms_logits(&self) -> bool {
        !self.logit_bias.is_empty() || self.has_penalties()
    }

    /// Set [`SamplingParams::logit_bias`] from `(token id, bias)` pairs in any order. Errors: a
    /// token id given twice (the message names `logit_bias`).
    pub fn with_logit_bias(mut self, mut bias: Vec<(u32, f32)>) -> Result<Self, RequestError> {
        bias.sort_by_key(|&(t, _)| t);
        if let Some(w) = bias.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(RequestError::InvalidParameter(format!(
                "logit_bias names token {} twice",
                w[0].0
            )));
        }
        self.logit_bias = bias;
        Ok(self)
    }

    /// How many leading tokens of `draft` the request's `logit_bias` does not ban (a bias of
    /// -100, OpenAI's "should result in a ban": the logit is lowered by 100, so the target all
    /// but never picks it). A drafter without logits of its own (n-gram lookup) may copy such a
    /// token from the context; it is not verified. Call it on deterministic drafts only: only
    /// what is verified changes, never what is committed, because such a draft is a function of
    /// the context.
    pub fn unbanned_prefix(&self, draft: &[u32]) -> usize {
        if self.logit_bias.is_empty() {
            return draft.len();
        }
        draft
            .iter()
            .take_while(|&&t| {
                self.logit_bias
                    .binary_search_by_key(&t, |&(id, _)| id)
                    .map_or(true, |i| self.logit_bias[i].1 > -100.0)
            })
            .count()
    }

    /// Check ranges; the error names the parameter.
    pub fn validate(&self) -> Result<(), RequestError> {
        let bad = |m: String| Err(RequestError::InvalidParameter(m));
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad(format!("temperature must be >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad(format!(
                "repetition_penalty must be > 0, got {}",
                self.repetition_penalty
            ));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(format!("{name} must be in [-2, 2], got {v}"));
            }
        }
        if let Some(&(t, b)) = self.logit_bias.iter().find(|(_, b)| !(-100.0..=100.0).contains(b)) {
            return bad(format!("logit_bias of token {t} must be in [-100, 100], got {b}"));
        }
        if self.logit_bias.windows(2).any(|w| w[0].0 >= w[1].0) {
            return bad("logit_bias token ids must be ascending and distinct".into());
        }
        Ok(())
    }
}

/// Per-request sampler state: parameters, the noise key and RNG, token counts for penalties.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    /// The key of this request's draws ([`keyed_draw`]), from its seed.
    key: u64,
    /// Derived streams (a drafter's, rejection sampling's), from the same seed.
    rng: ChaCha20Rng,
    /// (token id, count) of generated tokens, for penalties; small, so a sorted vec.
    counts: Vec<(u32, u32)>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let seed = params.seed.unwrap_or_else(rand::random);
        Self {
            params,
            key: noise_key(seed),
            rng: ChaCha20Rng::seed_from_u64(seed),
            counts: Vec::new(),
        }
    }

    /// The key of this request's draws: [`Sampler::draw`] at position `pos` is
    /// `keyed_draw(key, pos, dist)`. A drafter that draws its tokens with the same key
    /// proposes what the target will sample wherever their distributions agree
    /// ([`crate::speculative::SampledVerify::Coupled`]).
    pub fn noise_key(&self) -> u64 {
        self.key
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Record a committed token (for penalties). Call once per committed token, in order.
    pub fn observe(&mut self, token: u32) {
        match self.counts.binary_search_by_key(&token, |&(t, _)| t) {
            Ok(i) => self.counts[i].1 += 1,
            Err(i) => self.counts.insert(i, (token, 1)),
        }
    }

    /// The request's changes to a row of logits, in place: the logit bias, then the penalties
    /// (llama.cpp's sampler order). Every row that is sampled or verified goes through this,
    /// AR or speculative, so both see the same values.
    pub fn process_logits(&self, logits: &mut [f32]) {
        let p = &self.params;
        add_logit_bias(logits, &p.logit_bias);
        if !p.has_penalties() {
            return;
        }
        for &(tok, count) in &self.counts {
            let Some(l) = logits.get_mut(tok as usize) else {
                continue;
            };
            if p.repetition_penalty != 1.0 {
                if *l > 0.0 {
                    *l /= p.repetition_penalty;
                } else {
                    *l *= p.repetition_penalty;
                }
            }
            *l -= p.presence_penalty + p.frequency_penalty * count as f32;
        }
    }

    /// The processed distribution the sampler draws from, as `(token id, probability)` pairs
    /// sorted by descending probability (ties: lower id first), zero-probability tokens omitted.
    /// For greedy this is the one-hot argmax. [`Sampler::process_logits`] must already have run
    /// on `logits`.
    pub fn distribution(&self, logits: &[f32]) -> Vec<(u32, f32)> {
        let p = &self.params;
        if p.is_greedy() {
            return vec![(argmax(logits), 1.0)];
        }
        // Subtract the max before dividing by the temperature, so a tiny temperature gives
        // (0, -large) rather than inf - inf = NaN.
        let top = logits
            .iter()
            .copied()
            .filter(|l| l.is_finite())
            .fold(f32::NEG_INFINITY, f32::max);
        let t = p.temperature;
        // Sorted on one integer key per token (see `descending_key`): the order of
        // `sort_by(value desc, id asc)`, at about an eighth of its time on a 49k-entry row.
        let mut keys: Vec<u64> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, &l)| descending_key(i as u32, (l - top) / t))
            .collect();
        if p.top_k > 0 && keys.len() > p.top_k {
            keys.select_nth_unstable(p.top_k - 1);
            keys.truncate(p.top_k);
        }
        keys.sort_unstable();
        let mut cand: Vec<(u32, f32)> = keys
            .iter()
            .map(|&k| {
                let i = k as u32;
                (i, (logits[i as usize] - top) / t)
            })
            .collect();
        let Some(&(_, max)) = cand.first() else {
            return vec![(argmax(logits), 1.0)];
        };
        let mut sum = 0.0f64;
        for c in cand.iter_mut() {
            c.1 = (c.1 - max).exp();
            sum += c.1 as f64;
        }
        for c in cand.iter_mut() {
            c.1 = (c.1 as f64 / sum) as f32;
        }
        if p.top_p < 1.0 {
            let mut acc = 0.0f32;
            let mut keep = cand.len();
            for (i, c) in cand.iter().enumerate() {
                acc += c.1;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep);
        }
        if p.min_p > 0.0 {
            let thr = cand[0].1 * p.min_p;
            cand.retain(|c| c.1 >= thr);
        }
        let total: f64 = cand.iter().map(|c| c.1 as f64).sum();
        for c in cand.iter_mut() {
            c.1 = (c.1 as f64 / total) as f32;
        }
        cand
    }

    /// The token at sequence position `pos` (the number of tokens before it, prompt included)
    /// drawn from a distribution made by [`Sampler::distribution`]: [`keyed_draw`] with this
    /// request's key. The same seed, position and distribution give the same token, whatever
    /// was drawn before.
    pub fn draw(&self, dist: &[(u32, f32)], pos: usize) -> u32 {
        keyed_draw(self.key, pos, dist)
    }

    /// One token from `dist` by inverse CDF over a uniform from this request's RNG stream
    /// (each call consumes one): the draws of a drafter under rejection sampling, whose q
    /// must be independent of the acceptance's uniforms and of earlier drafts' outcomes, and
    /// plain draws of requests without a seed (cheaper than [`Sampler::draw`], whose
    /// position-keyed draws only seeded and coupled requests need).
    pub fn draw_from_stream(&mut self, dist: &[(u32, f32)]) -> u32 {
        if dist.len() == 1 {
            return dist[0].0;
        }
        let u: f32 = self.rng.gen();
        let mut acc = 0.0f32;
        for &(tok, prob) in dist {
            acc += prob;
            if u < acc {
                return tok;
            }
        }
        dist[dist.len() - 1].0
    }

    /// A seed for a derived RNG (a drafter's, speculative acceptance's), drawn from this request's
    /// RNG so a seeded request stays reproducible.
    pub fn fork_seed(&mut self) -> u64 {
        self.rng.gen()
    }

    /// Logit bias, penalties, transforms and one draw: the token at sequence position `pos`
    /// for this row of logits.
    pub fn sample(&mut self, logits: &mut [f32], pos: usize) -> u32 {
        self.process_logits(logits);
        if self.params.is_greedy() {
            return argmax(logits);
        }
        let dist = self.distribution(logits);
        self.draw(&dist, pos)
    }
}

/// SplitMix64's output function (Steele, Lea, Flood 2014, "Fast splittable pseudorandom number
/// generators"; the constants of Java's `SplittableRandom`) applied to `z`: a bijection of u64
/// that passes BigCrush on a counter.
pub fn splitmix64(z: u64) -> u64 {
    let mut z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The draw key of a request seed ([`keyed_draw`]).
pub fn noise_key(seed: u64) -> u64 {
    splitmix64(seed ^ 0x5EED_DA7A_0F5E_C01A)
}

/// The noise stream of one sequence position under `key`.
fn position_stream(key: u64, pos: usize) -> u64 {
    splitmix64(key ^ splitmix64(pos as u64))
}

/// Counter-based uniform noise in (0, 1] of token `token` at the position whose stream is
/// `stream` ([`position_stream`]): SplitMix64 of the stream advanced by the token id, 53 bits.
fn unit_noise(stream: u64, token: u32) -> f64 {
    let x = splitmix64(stream.wrapping_add((token as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)));
    ((x >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// The token at sequence position `pos` drawn from `dist` (sparse `(token id, probability)`
/// pairs, e.g. [`Sampler::distribution`], probabilities > 0; descending probability first makes
/// it fastest) with noise key `key` ([`noise_key`]): the exponential race
/// `argmin_v E_v / p(v)`, `E_v = -ln u_v`, `u_v` = [`unit_noise`] of (key, pos, v), which picks
/// v with probability p(v) (the Gumbel-max trick: `-ln E_v` is a standard Gumbel). Ties keep the
/// earlier entry. Deterministic: a function of (key, pos, dist) alone, so a drafter drawing from
/// its own q with the same key proposes the target's token wherever the two races agree
/// (Daliri et al. 2024: with probability at least (1 - TV(p, q)) / (1 + TV(p, q))).
///
/// Cost: one SplitMix64 and one multiply-compare per entry; the logarithm only for entries that
/// can still win (`u > 1 - b·p` is necessary for `E/p < b`, since `e^{-x} >= 1 - x`).
/// An empty `dist` gives token 0.
pub fn keyed_draw(key: u64, pos: usize, dist: &[(u32, f32)]) -> u32 {
    match dist {
        [] => return 0,
        [(t, _)] => return *t,
        _ => {}
    }
    let stream = position_stream(key, pos);
    let (mut best_t, mut best) = (dist[0].0, f64::INFINITY);
    for &(t, p) in dist {
        let p = p as f64;
        if p <= 0.0 {
            continue;
        }
        let u = unit_noise(stream, t);
        if u <= 1.0 - best * p {
            continue;
        }
        let e = -u.ln() / p;
        if e < best {
            (best_t, best) = (t, e);
        }
    }
    best_t
}

/// A sort key for `(id, value)` whose ascending order is descending `value` in
/// [`f32::total_cmp`]'s total order, ties broken by ascending `id`: the high 32 bits are the
/// value's total-order rank inverted, the low 32 bits the id (`key as u32` recovers it).
pub fn descending_key(id: u32, value: f32) -> u64 {
    let bits = value.to_bits() as i32;
    // total_cmp's transform: negative values get their magnitude bits flipped, so the bits
    // compare as signed integers in the total order; the sign flip makes that unsigned.
    let signed = bits ^ ((((bits >> 31) as u32) >> 1) as i32);
    let ascending = (signed as u32) ^ 0x8000_0000;
    (u64::from(!ascending) << 32) | u64::from(id)
}

/// The largest value of a row, over 16 lanes (a loop the compiler vectorizes); NaN never wins;
/// `-inf` for an empty row.
pub fn max_value(xs: &[f32]) -> f32 {
    const L: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; L];
    let chunks = xs.chunks_exact(L);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            // `>`: NaN never replaces a lane's maximum.
            *m = if v > *m { v } else { *m };
        }
    }
    let mut max = f32::NEG_INFINITY;
    for &v in lanes.iter().chain(tail) {
        max = if v > max { v } else { max };
    }
    max
}

/// Index of the largest value; the lowest index wins ties; NaN never wins (0 when no value
/// is above -inf). The definition is the scan "keep `i` when `xs[i] > best`" from
/// `best = -inf` ([`argmax_scan`]); this computes the same index in two branch-free passes
/// (the maximum over 16 lanes, then its first position), about 5x faster on a 49k-entry row,
/// which greedy decoding runs once per sequence per step.
pub fn argmax(xs: &[f32]) -> u32 {
    let max = max_value(xs);
    if max == f32::NEG_INFINITY {
        return 0;
    }
    xs.iter().position(|&v| v == max).unwrap_or(0) as u32
}

/// The definition [`argmax`] implements: one scan keeping the first strictly larger value.
pub fn argmax_scan(xs: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in xs.iter().enumerate() {
        if v > best_v {
            best_v = v;
            best = i;
        }
    }
    best as u32
}

/// Log-softmax of one row, computed in f64 for a stable normaliser.
pub fn log_softmax(xs: &[f32]) -> Vec<f32> {
    let max = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = xs.iter().map(|&x| ((x - max) as f64).exp()).sum();
    let lse = max as f64 + sum.ln();
    xs.iter().map(|&x| (x as f64 - lse) as f32).collect()
}

/// The `n` largest entries of `logprobs` as `(id, logprob)`, best first (ties: lower id first).
pub fn top_n(logprobs: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut idx: Vec<(u32, f32)> = logprobs.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
    let n = n.min(idx.len());
    if n == 0 {
        return Vec::new();
    }
    idx.select_nth_unstable_by(n - 1, |a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    idx.truncate(n);
    idx.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    idx
}

/// OpenAI's `logit_bias` on a logits row, in place: `logits[id] += bias` for each `(id, bias)`;
/// ids past the row are skipped. The first of [`Sampler::process_logits`]'s changes, and what a
/// drafter adds to its own rows ([`crate::speculative::DraftSampling`]).
pub fn add_logit_bias(logits: &mut [f32], bias: &[(u32, f32)]) {
    for &(tok, b) in bias {
        if let Some(l) = logits.get_mut(tok as usize) {
            *l += b;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A draft is cut before its first token with a bias of -100 (a ban); other biases, and
    /// tokens without one, stay.
    #[test]
    fn a_draft_is_cut_before_a_banned_token() {
        let p = SamplingParams::greedy()
            .with_logit_bias(vec![(7, -100.0), (3, -99.5), (9, 100.0)])
            .expect("bias");
        assert_eq!(p.unbanned_prefix(&[1, 3, 9, 7, 2]), 3);
        assert_eq!(p.unbanned_prefix(&[7]), 0);
        assert_eq!(p.unbanned_prefix(&[1, 2]), 2);
        assert_eq!(SamplingParams::greedy().unbanned_prefix(&[7, 7]), 2);
    }

    /// The bias comes before the penalties: a logit of 0.5 biased by -1 is -0.5, which a
    /// repetition penalty of 2 doubles (a negative logit is multiplied) to -1.0; the other order
    /// would give 0.25 - 1 = -0.75. Tokens past the row are ignored.
    #[test]
    fn logit_bias_comes_before_the_penalties() {
        let p = SamplingParams {
            repetition_penalty: 2.0,
            ..SamplingParams::greedy()
        }
        .with_logit_bias(vec![(9, 5.0), (1, -1.0)])
        .expect("bias");
        let mut s = Sampler::new(p);
        s.observe(1);
        let mut row = vec![0.5f32, 0.5, 0.5];
        s.process_logits(&mut row);
        assert_eq!(row, vec![0.5, -1.0, 0.5]);
        let twice = SamplingParams::greedy().with_logit_bias(vec![(3, 1.0), (3, 2.0)]);
        assert!(twice.is_err_and(|e| e.to_string().contains("logit_bias")));
    }

    #[test]
    fn argmax_is_the_first_strict_maximum_of_the_scan() {
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let special = [f32::NAN, f32::NEG_INFINITY, f32::INFINITY, -0.0, 0.0, 1.0, -1.0];
        for case in 0..4000 {
            let n = case % 70;
            let xs: Vec<f32> = (0..n)
                .map(|_| {
                    let r = next();
                    match r % 10 {
                        // Few distinct values: many ties.
                        0..=3 => (r >> 8) as f32 % 4.0,
                        4 | 5 => special[(r >> 8) as usize % special.len()],
                        _ => ((r >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32,
                    }
                })
                .collect();
            assert_eq!(argmax(&xs), argmax_scan(&xs), "{xs:?}");
        }
        assert_eq!(argmax(&[]), 0);
        assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY, 2.0, 2.0]), 2);
        assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY]), 0);
        assert_eq!(argmax(&[-0.0, 0.0]), 0, "-0 == 0: the first wins");
        let mut big = vec![0.5f32; 49_152];
        big[40_000] = 0.75;
        big[45_000] = 0.75;
        assert_eq!(argmax(&big), 40_000);
    }

    #[test]
    fn tiny_temperature_is_near_greedy_not_nan() {
        for t in [1e-38f32, 1e-40, 1e-6] {
            let mut s = Sampler::new(SamplingParams {
                temperature: t,
                seed: Some(3),
                ..Default::default()
            });
            for pos in 0..20 {
                assert_eq!(s.sample(&mut [0.5, 3.0, 2.9, -1.0], pos), 1, "temperature {t}");
            }
        }
    }

    #[test]
    fn greedy_is_argmax_lowest_id_on_tie() {
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&mut [0.1, 3.0, 3.0, -1.0], 0), 1);
    }

    #[test]
    fn same_seed_same_draws() {
        let p = SamplingParams {
            seed: Some(7),
            ..Default::default()
        };
        let logits = vec![0.5f32, 0.4, 0.3, 0.2, 0.1];
        let mut a = Sampler::new(p.clone());
        let mut b = Sampler::new(p);
        let xa: Vec<u32> = (0..50).map(|i| a.sample(&mut logits.clone(), i)).collect();
        let xb: Vec<u32> = (0..50).rev().map(|i| b.sample(&mut logits.clone(), i)).collect();
        assert_eq!(
            xa,
            xb.into_iter().rev().collect::<Vec<_>>(),
            "a draw depends on its position, not on the draws before it"
        );
        assert!(
            xa.iter().any(|&t| t != xa[0]),
            "temperature 1 over near-uniform logits must vary"
        );
        let mut c = Sampler::new(SamplingParams {
            seed: Some(8),
            ..Default::default()
        });
        let xc: Vec<u32> = (0..50).map(|i| c.sample(&mut logits.clone(), i)).collect();
        assert_ne!(xa, xc, "another seed, other draws");
    }

    /// A random sparse distribution of `n` entries over ids below 1000, sorted as
    /// [`Sampler::distribution`] sorts (descending probability).
    fn random_dist(next: &mut impl FnMut() -> u64, n: usize) -> Vec<(u32, f32)> {
        let mut ids: Vec<u32> = Vec::new();
        while ids.len() < n {
            let id = (next() % 1000) as u32;
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        // Heavy-tailed weights: a few large, many tiny (as in a language model's row).
        let w: Vec<f64> = ids
            .iter()
            .map(|_| (-((next() >> 11) as f64 / (1u64 << 53) as f64 * 12.0)).exp())
            .collect();
        let total: f64 = w.iter().sum();
        let mut d: Vec<(u32, f32)> = ids.iter().zip(&w).map(|(&t, &x)| (t, (x / total) as f32)).collect();
        d.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        d
    }

    fn xorshift(mut state: u64) -> impl FnMut() -> u64 {
        move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        }
    }

    #[test]
    fn keyed_draw_is_the_exponential_race_in_any_order() {
        // The pruned race equals the race over every entry, and does not depend on the order
        // of `dist` (ties aside, which random weights do not have).
        let mut next = xorshift(0x1234_5678_9ABC_DEF1);
        for case in 0..2000 {
            let d = random_dist(&mut next, 2 + case % 40);
            let key = noise_key(case as u64);
            let pos = (next() % 5000) as usize;
            let stream = position_stream(key, pos);
            let full = d
                .iter()
                .map(|&(t, p)| (-unit_noise(stream, t).ln() / p as f64, t))
                .min_by(|a, b| a.0.total_cmp(&b.0))
                .map(|x| x.1);
            let t = keyed_draw(key, pos, &d);
            assert_eq!(Some(t), full, "case {case}");
            let mut rev = d.clone();
            rev.reverse();
            assert_eq!(keyed_draw(key, pos, &rev), t, "case {case}: order");
        }
    }

    #[test]
    fn keyed_draws_follow_the_distribution() {
        // Over positions, token frequencies match p: chi-square over 6 tokens (5 degrees of
        // freedom; 25 is far past the 0.9999 quantile, 25.7). A fixed computation: it cannot flake.
        let d = [(7u32, 0.4f32), (3, 0.25), (11, 0.15), (2, 0.1), (40, 0.07), (5, 0.03)];
        let n = 200_000usize;
        for seed in [1u64, 2, 3] {
            let key = noise_key(seed);
            let mut counts = [0usize; 6];
            for pos in 0..n {
                let t = keyed_draw(key, pos, &d);
                let i = d.iter().position(|x| x.0 == t).expect("a token of dist");
                counts[i] += 1;
            }
            let chi2: f64 = d
                .iter()
                .zip(counts)
                .map(|(&(_, p), c)| {
                    let e = p as f64 * n as f64;
                    (c as f64 - e).powi(2) / e
                })
                .sum();
            assert!(chi2 < 25.0, "seed {seed}: chi2 {chi2}, counts {counts:?}");
        }
    }

    #[test]
    fn keyed_draws_of_close_distributions_mostly_agree() {
        // The coupling a drafter gets by drawing with the target's key: agreement at least
        // (1 - TV) / (1 + TV) (Daliri et al. 2024), and well above what independent draws give.
        let mut next = xorshift(0xDEAD_BEEF_CAFE_F00D);
        for case in 0..20 {
            let p = random_dist(&mut next, 30);
            // q: p with every probability moved by up to ±50%, renormalised.
            let mut q: Vec<(u32, f32)> = p
                .iter()
                .map(|&(t, x)| (t, x * (0.5 + (next() % 1000) as f32 / 1000.0)))
                .collect();
            let total: f32 = q.iter().map(|x| x.1).sum();
            q.iter_mut().for_each(|x| x.1 /= total);
            q.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let tv: f64 = p
                .iter()
                .map(|&(t, x)| (x as f64 - q.iter().find(|y| y.0 == t).map_or(0.0, |y| y.1 as f64)).abs())
                .sum::<f64>()
                / 2.0;
            let key = noise_key(case);
            let n = 20_000;
            let agree = (0..n)
                .filter(|&pos| keyed_draw(key, pos, &p) == keyed_draw(key, pos, &q))
                .count() as f64
                / n as f64;
            let bound = (1.0 - tv) / (1.0 + tv);
            let independent: f64 = p
                .iter()
                .map(|&(t, x)| x as f64 * q.iter().find(|y| y.0 == t).map_or(0.0, |y| y.1 as f64))
                .sum();
            assert!(
                agree > bound - 0.02,
                "case {case}: agreement {agree} below (1-TV)/(1+TV) = {bound}"
            );
            assert!(
                agree > independent + 0.1,
                "case {case}: agreement {agree}, independent draws {independent}"
            );
        }
    }

    #[test]
    fn descending_key_orders_as_the_comparator() {
        // Every class of finite value, ties, signed zeros and extremes, in scrambled order.
        let mut vals = vec![
            0.0f32,
            -0.0,
            1.0,
            -1.0,
            1.0,
            f32::MAX,
            f32::MIN,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
        ];
        vals.extend([1e-40f32, -1e-40, 3.5, -3.5, 3.5, 0.0, 2.25, -1e30, 1e30]);
        let mut s = 0x2545_F491_4F6C_DD1Du64;
        for _ in 0..5000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            // Any bit pattern but inf and NaN (the distribution filters those out first).
            let v = f32::from_bits((s >> 32) as u32);
            if v.is_finite() {
                vals.push(v);
            }
            vals.push(((s >> 8) % 64) as f32 / 8.0 - 4.0); // many exact ties
        }
        let mut by_cmp: Vec<(u32, f32)> = vals.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
        by_cmp.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut keys: Vec<u64> = vals
            .iter()
            .enumerate()
            .map(|(i, &v)| descending_key(i as u32, v))
            .collect();
        keys.sort_unstable();
        let by_key: Vec<u32> = keys.iter().map(|&k| k as u32).collect();
        assert_eq!(by_key, by_cmp.iter().map(|x| x.0).collect::<Vec<_>>());
    }

    /// The distribution as it was computed before the keyed sort (one comparator sort of every
    /// token), kept as the reference the fast path must equal bit for bit.
    fn reference_distribution(p: &SamplingParams, logits: &[f32]) -> Vec<(u32, f32)> {
        let top = logits
            .iter()
            .copied()
            .filter(|l| l.is_finite())
            .fold(f32::NEG_INFINITY, f32::max);
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, &l)| (i as u32, (l - top) / p.temperature))
            .collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 && cand.len() > p.top_k {
            cand.truncate(p.top_k);
        }
        let max = cand[0].1;
        let mut sum = 0.0f64;
        for c in cand.iter_mut() {
            c.1 = (c.1 - max).exp();
            sum += c.1 as f64;
        }
        for c in cand.iter_mut() {
            c.1 = (c.1 as f64 / sum) as f32;
        }
        if p.top_p < 1.0 {
            let mut acc = 0.0f32;
            let mut keep = cand.len();
            for (i, c) in cand.iter().enumerate() {
                acc += c.1;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep);
        }
        if p.min_p > 0.0 {
            let thr = cand[0].1 * p.min_p;
            cand.retain(|c| c.1 >= thr);
        }
        let total: f64 = cand.iter().map(|c| c.1 as f64).sum();
        for c in cand.iter_mut() {
            c.1 = (c.1 as f64 / total) as f32;
        }
        cand
    }

    #[test]
    fn distribution_equals_the_full_sort_reference_bit_for_bit() {
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        for case in 0..24 {
            let n = [5usize, 300, 49_152][case % 3];
            // Logits with ties (quantised values), a few -inf, and a peaked or flat spread.
            let spread = [2.0f32, 12.0, 30.0][(case / 3) % 3];
            let logits: Vec<f32> = (0..n)
                .map(|_| {
                    let r = next();
                    if r % 97 == 0 {
                        f32::NEG_INFINITY
                    } else {
                        ((r >> 20) % 4096) as f32 / 4096.0 * spread - spread / 2.0
                    }
                })
                .collect();
            let params = SamplingParams {
                temperature: [0.3f32, 0.8, 1.0, 1.7][case % 4],
                top_k: [0usize, 1, 40, 4][(case / 2) % 4],
                top_p: [1.0f32, 0.9, 0.5][case % 3],
                min_p: [0.0f32, 0.05][(case / 4) % 2],
                ..Default::default()
            };
            let fast = Sampler::new(params.clone()).distribution(&logits);
            let slow = reference_distribution(&params, &logits);
            assert_eq!(fast.len(), slow.len(), "case {case}");
            for (a, b) in fast.iter().zip(&slow) {
                assert_eq!((a.0, a.1.to_bits()), (b.0, b.1.to_bits()), "case {case}");
            }
        }
    }

    #[test]
    fn top_k_top_p_min_p_filter() {
        let logits = [2.0f32, 1.0, 0.0, -1.0];
        let s = Sampler::new(SamplingParams {
            top_k: 2,
            ..Default::default()
        });
        let d = s.distribution(&logits);
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![0, 1]);
        let e1 = (1.0f32).exp();
        assert!((d[0].1 - e1 / (e1 + 1.0)).abs() < 1e-6);

        // probabilities of [2,1,0,-1]: 0.6439, 0.2369, 0.0871, 0.0321
        let s = Sampler::new(SamplingParams {
            top_p: 0.85,
            ..Default::default()
        });
        assert_eq!(s.distribution(&logits).len(), 2);
        let s = Sampler::new(SamplingParams {
            top_p: 0.95,
            ..Default::default()
        });
        assert_eq!(s.distribution(&logits).len(), 3);
        let s = Sampler::new(SamplingParams {
            min_p: 0.2,
            ..Default::default()
        });
        assert_eq!(s.distribution(&logits).len(), 2);
    }

    #[test]
    fn penalties_follow_definitions() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 0.0,
            repetition_penalty: 2.0,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..Default::default()
        });
        s.observe(0);
        s.observe(1);
        s.observe(1);
        let mut l = [4.0f32, -4.0, 1.0];
        s.process_logits(&mut l);
        assert_eq!(l, [4.0 / 2.0 - 0.5 - 0.25, -4.0 * 2.0 - 0.5 - 0.5, 1.0]);
    }

    #[test]
    fn validate_rejects_bad_ranges() {
        assert!(SamplingParams {
            temperature: -0.1,
            ..Default::default()
        }
        .validate()
        .is_err());
        assert!(SamplingParams {
            top_p: 0.0,
            ..Default::default()
        }
        .validate()
        .is_err());
        assert!(SamplingParams {
            repetition_penalty: 0.0,
            ..Default::default()
        }
        .validate()
        .is_err());
        assert!(SamplingParams::default().validate().is_ok());
    }

    #[test]
    fn max_value_skips_nan() {
        assert_eq!(max_value(&[1.0, f32::NAN, 3.0, -2.0]), 3.0);
        assert_eq!(max_value(&[]), f32::NEG_INFINITY);
        let long: Vec<f32> = (0..37).map(|i| if i == 33 { 9.0 } else { f32::NAN }).collect();
        assert_eq!(max_value(&long), 9.0);
    }

    #[test]
    fn log_softmax_and_top_n() {
        let lp = log_softmax(&[1.0, 2.0, 3.0]);
        let total: f32 = lp.iter().map(|x| x.exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert_eq!(top_n(&lp, 2).iter().map(|x| x.0).collect::<Vec<_>>(), vec![2, 1]);
    }
}
