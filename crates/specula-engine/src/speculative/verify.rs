//! Verification: the one place where draft tokens are accepted or rejected.
//!
//! - [`accept_greedy`]: temperature 0. The committed block is the longest draft prefix equal to
//!   the target's argmax, then the target's own token. Byte-identical to plain decoding given
//!   batch-invariant verify rows.
//! - [`accept_sampled`]: temperature > 0. Speculative sampling (Leviathan, Kalman, Matias 2023,
//!   "Fast Inference from Transformers via Speculative Decoding", Algorithm 1; Chen et al. 2023,
//!   "Accelerating Large Language Model Decoding with Speculative Sampling", Algorithm 2):
//!   accept draft token d with probability min(1, p(d)/q(d)); at the first rejection draw from
//!   norm(max(0, p - q)); after a full accept draw a bonus token from p. Every committed token is
//!   distributed exactly as plain sampling from p would give it.

use std::collections::HashMap;

use rand::Rng;

use crate::sampling::{argmax, Sampler};

/// The randomness [`accept_sampled`] consumes, as decisions rather than raw numbers, so a test can
/// enumerate every outcome with its exact probability (see the S-law test) while production draws
/// uniforms from the request's RNG.
pub trait Randomness {
    /// `true` with probability `prob`. Callers pass a value in [0, 1].
    fn bernoulli(&mut self, prob: f64) -> bool;
    /// Index `i` with probability `weights[i] / sum(weights)`; weights are >= 0 with a positive sum.
    fn categorical(&mut self, weights: &[f64]) -> usize;
}

/// [`Randomness`] from any RNG: one uniform in [0, 1) per decision (inverse CDF for categorical).
#[derive(Debug, Clone)]
pub struct UniformRandomness<R: Rng>(pub R);

impl<R: Rng> Randomness for UniformRandomness<R> {
    fn bernoulli(&mut self, prob: f64) -> bool {
        self.0.gen::<f64>() < prob
    }

    fn categorical(&mut self, weights: &[f64]) -> usize {
        let total: f64 = weights.iter().sum();
        let u = self.0.gen::<f64>() * total;
        let mut acc = 0.0;
        let mut last = 0;
        for (i, &w) in weights.iter().enumerate() {
            if w <= 0.0 {
                continue;
            }
            acc += w;
            last = i;
            if u < acc {
                return i;
            }
        }
        last
    }
}

/// Probability of `token` in a sparse distribution.
fn prob_of(dist: &[(u32, f32)], token: u32) -> f64 {
    dist.iter().find(|&&(t, _)| t == token).map_or(0.0, |&(_, p)| p as f64)
}

/// Speculative sampling acceptance for one verified block.
///
/// - `draft`: the proposed tokens d1..dk.
/// - `q`: for a sampling drafter, `q[i]` is the distribution `draft[i]` was drawn from (sparse
///   `(token, prob)`); `None` for a deterministic drafter, whose q is one-hot on each draft token.
/// - `target(i)`: the target's processed distribution p at row i (after the committed prefix and
///   `draft[..i]`), sparse `(token, prob)`; it is called for rows 0, 1, ... in order, and row i only
///   after `draft[..i]` were accepted, so penalties can treat those drafts as committed.
/// - `rng`: the acceptance randomness.
///
/// Returns the accepted prefix length `a` and the token drawn after it: from norm(max(0, p - q))
/// at a rejection, or from p after a full accept (the bonus token). The committed block is
/// `draft[..a]` then that token.
///
/// When p and q agree on no token (`max(0, p - q)` sums to zero, which requires p = q on the
/// rejected row, a probability-zero event), the token is drawn from p.
pub fn accept_sampled(
    draft: &[u32],
    q: Option<&[Vec<(u32, f32)>]>,
    target: &mut dyn FnMut(usize) -> Vec<(u32, f32)>,
    rng: &mut dyn Randomness,
) -> (usize, u32) {
    for (i, &d) in draft.iter().enumerate() {
        let p = target(i);
        let qi = q.and_then(|q| q.get(i));
        let pd = prob_of(&p, d);
        let qd = qi.map_or(1.0, |qi| prob_of(qi, d));
        // qd == 0 cannot happen for a token drawn from q; treat it as a certain rejection.
        let accept_prob = if qd > 0.0 { (pd / qd).min(1.0) } else { 0.0 };
        if accept_prob > 0.0 && rng.bernoulli(accept_prob) {
            continue;
        }
        // Rejected: draw from the residual norm(max(0, p - q)).
        let qmap: HashMap<u32, f64> = match qi {
            Some(qi) => qi.iter().map(|&(t, w)| (t, w as f64)).collect(),
            None => HashMap::from([(d, 1.0)]),
        };
        let residual: Vec<f64> = p
            .iter()
            .map(|&(t, w)| (w as f64 - qmap.get(&t).copied().unwrap_or(0.0)).max(0.0))
            .collect();
        let next = if residual.iter().any(|&w| w > 0.0) {
            p[rng.categorical(&residual)].0
        } else {
            draw_from(&p, rng)
        };
        return (i, next);
    }
    let p = target(draft.len());
    (draft.len(), draw_from(&p, rng))
}

/// One draw from a sparse distribution.
fn draw_from(p: &[(u32, f32)], rng: &mut dyn Randomness) -> u32 {
    if p.len() == 1 {
        return p[0].0;
    }
    let w: Vec<f64> = p.iter().map(|&(_, w)| w as f64).collect();
    p[rng.categorical(&w)].0
}

/// Greedy acceptance (temperature 0). `target(i)` is the target's choice at row i: the argmax of
/// the row's logits after the committed prefix and `draft[..i]`, processed exactly as plain
/// decoding would process it at that position (penalties and constraints seeing `draft[..i]` as
/// committed). It is called for rows 0, 1, ... in order, row i only after `draft[..i]` were
/// accepted.
///
/// Returns the accepted prefix length `a` and the token the target itself chooses after it (the
/// correction at the first mismatch, or the bonus token after a full accept). The committed
/// block is `draft[..a]` followed by that token.
pub fn accept_greedy(draft: &[u32], target: &mut dyn FnMut(usize) -> u32) -> (usize, u32) {
    for i in 0..=draft.len() {
        let t = target(i);
        match draft.get(i) {
            Some(&d) if d == t => continue,
            _ => return (i, t),
        }
    }
    unreachable!("the last row has no draft token and always returns")
}

/// [`accept_greedy`] over precomputed rows with a sampler's logit bias and penalties
/// ([`Sampler::process_logits`]): row i is processed with the sampler having observed
/// `draft[..i]` (the sampler is left having observed the accepted drafts; the returned token is
/// not observed).
pub fn accept_greedy_rows(draft: &[u32], rows: &mut [Vec<f32>], sampler: &mut Sampler) -> (usize, u32) {
    debug_assert_eq!(rows.len(), draft.len() + 1);
    debug_assert!(sampler.params().is_greedy());
    let mut observed = 0;
    accept_greedy(draft, &mut |i| {
        while observed < i {
            sampler.observe(draft[observed]);
            observed += 1;
        }
        sampler.process_logits(&mut rows[i]);
        argmax(&rows[i])
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::SamplingParams;

    fn onehot(v: usize, t: usize) -> Vec<f32> {
        let mut r = vec![0.0; v];
        r[t] = 1.0;
        r
    }

    #[test]
    fn accepts_the_matching_prefix_then_corrects() {
        let mut s = Sampler::new(SamplingParams::greedy());
        let mut rows = vec![onehot(8, 3), onehot(8, 4), onehot(8, 6), onehot(8, 1)];
        assert_eq!(accept_greedy_rows(&[3, 4, 5], &mut rows, &mut s), (2, 6));
        let mut rows = vec![onehot(8, 3), onehot(8, 4), onehot(8, 5), onehot(8, 1)];
        assert_eq!(
            accept_greedy_rows(&[3, 4, 5], &mut rows, &mut s),
            (3, 1),
            "bonus after a full accept"
        );
        let mut rows = vec![onehot(8, 2)];
        assert_eq!(
            accept_greedy_rows(&[], &mut rows, &mut s),
            (0, 2),
            "empty draft = one AR step"
        );
    }

    #[test]
    fn penalties_see_earlier_draft_tokens() {
        // Token 3 is accepted at row 0; at row 1 the repetition penalty on 3 must flip the
        // argmax from 3 to 4, exactly as plain decoding would after committing 3.
        let p = SamplingParams {
            temperature: 0.0,
            repetition_penalty: 2.0,
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(p);
        let mut rows = vec![vec![0.0, 0.0, 0.0, 1.0, 0.9], vec![0.0, 0.0, 0.0, 1.0, 0.9]];
        assert_eq!(accept_greedy_rows(&[3], &mut rows, &mut s), (1, 4));
    }
}
