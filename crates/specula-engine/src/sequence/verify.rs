//! The verify stage of a sequence's step: the target's rows processed as plain decoding
//! processes them, and the draft accepted or rejected by [`crate::speculative::verify`], the one
//! place acceptance happens.

use super::*;
use crate::speculative::verify;

/// What verification decided.
pub(super) struct Verified {
    /// Drafts accepted (a prefix of the draft).
    pub accepted: usize,
    /// The token after them: the bonus token when every draft was accepted, else the correction.
    pub next: u32,
    /// Every row's logprobs (all tokens' and the top entries), when the request asked for them.
    pub lps: Option<Vec<(Vec<f32>, Vec<TopLogprob>)>>,
}

impl Sequence {
    /// Verify `draft` against the target's `rows` (row i: the logits after the committed
    /// context and `draft[..i]`): each row processed as plain decoding processes it (logit
    /// bias, penalties, the constraint's mask, with the drafts before it observed as committed),
    /// then acceptance in [`verify`] (greedy match, coupling or rejection sampling), the one
    /// place drafts are accepted. Returns the accepted count, the token after them (the bonus
    /// token, or the correction) and, when the request asked for them, every row's logprobs
    /// (from the raw rows). The sampler and the constraint have observed the accepted drafts
    /// and the next token.
    pub(super) fn verify(&mut self, rows: &mut TargetRows, draft: &Proposal) -> anyhow::Result<Verified> {
        // rows[i] = logits after the committed prefix and draft[..i].
        let lps = match (&*rows, self.req.logprobs) {
            (TargetRows::Logits(rows), Some(n)) => Some(
                rows.iter()
                    .map(|r| token_logprobs(&self.env.tokenizer, r, n))
                    .collect::<Vec<_>>(),
            ),
            _ => None,
        };
        let sampling = !self.req.sampling.is_greedy();
        // Row i decides the token at sequence position `base + i`.
        let base = self.context.len();
        let key = self.sampler.noise_key();
        // Row processing as plain decoding does it: the logit bias and penalties, then the
        // constraint's mask; both see the drafts before a row as committed (observed in order,
        // row by row).
        let tokens = &draft.tokens;
        let mut observed = 0;
        let mut failure: Option<anyhow::Error> = None;
        let sampler = &mut self.sampler;
        let constraint = &mut self.constraint;
        // Returns the processed distribution of row i (one-hot argmax when greedy).
        let mut process = |i: usize, rows: &mut TargetRows| {
            while observed < i {
                sampler.observe(tokens[observed]);
                if let Some(c) = constraint.as_mut() {
                    if let Err(e) = c.commit(tokens[observed]) {
                        failure.get_or_insert(e);
                    }
                }
                observed += 1;
            }
            match rows {
                // `absorb_argmax` checked: greedy, no logit bias or penalties, no constraint.
                TargetRows::Argmax(a) => vec![(a[i], 1.0)],
                TargetRows::Logits(rows) => {
                    sampler.process_logits(&mut rows[i]);
                    if let Some(c) = constraint.as_mut() {
                        if let Err(e) = c.mask(&mut rows[i]) {
                            failure.get_or_insert(e);
                        }
                    }
                    sampler.distribution(&rows[i])
                }
            }
        };
        let (accepted, next, ar_dist) = match self.accept_rng.as_mut() {
            Some(rng) if sampling && !draft.is_empty() => {
                let (a, t) = verify::accept_sampled(tokens, draft.q.as_deref(), &mut |i| process(i, rows), rng);
                (a, t, None)
            }
            // Coupled: each row's token is the keyed draw plain decoding makes there, so the
            // drafts are checked against it as greedy drafts are against the argmax.
            _ if sampling && self.coupled && !draft.is_empty() => {
                let (a, t) = verify::accept_greedy(tokens, &mut |i| {
                    crate::sampling::keyed_draw(key, base + i, &process(i, rows))
                });
                (a, t, None)
            }
            _ if sampling => (0, 0, Some(process(0, rows))),
            _ => {
                let (a, t) = verify::accept_greedy(tokens, &mut |i| process(i, rows)[0].0);
                (a, t, None)
            }
        };
        let next = match ar_dist {
            // Keyed where it matters: coupling, or a seed (its output must not depend on
            // whether anything was drafted); otherwise the cheaper stream draw (about 0.1 ms a
            // token less on a 49k vocabulary).
            Some(dist) if self.coupled || self.req.sampling.seed.is_some() => self.sampler.draw(&dist, base),
            Some(dist) => self.sampler.draw_from_stream(&dist),
            None => next,
        };
        if let Some(e) = failure {
            return Err(e);
        }
        self.sampler.observe(next);
        if let Some(c) = self.constraint.as_mut() {
            c.commit(next)?;
        }
        Ok(Verified { accepted, next, lps })
    }
}
