//! The draft stage of a sequence's step: the next block to verify (its length from the
//! draft-length controller, its tokens from the n-gram lookup or the model drafter, cut where
//! the target would reject them anyway).

use super::*;

impl Sequence {
    /// Propose the next block: the controller's k (bounded by the context and the tokens left),
    /// the n-gram lookup or the model drafter, the prefix worth verifying, cut where the target
    /// would reject anyway; then the next input is `[next, draft...]`.
    pub(super) fn draft_next(&mut self, next: u32, mut delta: StreamDelta) -> anyhow::Result<StepOutcome> {
        let ctx = self.env.context_length;
        let room_ctx = ctx.saturating_sub(self.state.len() + 1);
        let room_out = self.max_tokens.saturating_sub(self.emitter.tokens().len() + 1);
        let k = self.k_ctl.next_k().min(room_ctx).min(room_out);
        let k = self.model_k(k, room_out);
        let lookup = self.lookup_draft(k, self.req.spec.draft_max.min(room_ctx).min(room_out));
        let mut proposal = match (lookup, self.drafter.as_mut()) {
            (Some((tokens, alphas)), _) => {
                self.lookup_alphas = Some(alphas);
                Proposal::deterministic(tokens)
            }
            (None, Some(d)) if k > 0 => {
                let catch_up = d.catch_up_tokens(&self.context);
                let td = Instant::now();
                let mut guide = StepGuide {
                    ctl: &self.k_ctl,
                    confidence_driven: self.k_ctl.confidence_driven(),
                    constraint: self.constraint.as_deref_mut().filter(|_| self.mask_drafts),
                };
                let p = d.propose_guided(&self.context, k, &mut guide)?;
                let secs = td.elapsed().as_secs_f64();
                self.stats.spec.draft_s += secs;
                // Catch-up after a pause is paid once per probe, not per draft token.
                self.k_ctl.observe_draft(p.len(), secs, d.last_catch_up_s());
                self.k_ctl.observe_catch_up(catch_up, d.last_catch_up_s());
                p
            }
            _ => Proposal::default(),
        };
        if self.lookup_alphas.is_none() {
            proposal.truncate(k);
        }
        if self.coupled {
            // Coupled drafts are verified against the target's own draws: a draft is a
            // deterministic guess whatever distribution it came from (every coupled drafter
            // returns none; a drafter that ignored `couple` would lose acceptance, not exactness).
            proposal.q = None;
        }
        // Verify the prefix the drafter's confidences say pays (greedy drafts only; the rest
        // is trimmed).
        let keep = self.k_ctl.verified_prefix(&proposal);
        if tracing::enabled!(tracing::Level::TRACE) {
            tracing::trace!(
                position = self.state.len(),
                k,
                proposed = proposal.len(),
                verified = keep,
                confidence = ?proposal.confidence,
                alphas = ?self.k_ctl.alphas(k.max(1)),
                verify_2_rows = self.k_ctl.relative_forward_cost(2),
                draft_cost = self.k_ctl.relative_draft_cost(),
                "draft step"
            );
        }
        self.stats.spec.trimmed += proposal.len() - keep;
        proposal.truncate(keep);
        if proposal.q.is_none() {
            // A deterministic draft (n-gram lookup, greedy or coupled model drafts) is cut before the first
            // token the target would reject anyway: one the grammar does not allow (the lookup
            // sees no grammar, and a model drafter's mask may not apply), or, as a heuristic,
            // one the request biases by -100 (the lookup copies it from the context). A sampled
            // draft is not cut: whether a drawn token is verified must not depend on the token
            // drawn. Verified, a forbidden token has p = 0 and is rejected, and that position
            // is drawn from the residual max(0, p - q) as rejection sampling requires; cut, it
            // would be drawn from p, and the law moves (`tests/spec.rs`
            // `sampled_drafts_under_a_grammar`).
            let mut keep = self.req.sampling.unbanned_prefix(&proposal.tokens);
            if let Some(c) = self.constraint.as_mut() {
                keep = c.valid_prefix(&proposal.tokens[..keep]);
            }
            proposal.truncate(keep);
        }
        if let Some(a) = self.lookup_alphas.as_mut() {
            a.truncate(proposal.len());
        }
        if self.state.len() + 1 + proposal.len() > ctx {
            let d = self.emitter.finish_with(FinishReason::Length);
            delta.text.push_str(&d.text);
            delta.token_ids.extend_from_slice(&d.token_ids);
            delta.logprobs.extend(d.logprobs);
            return Ok(StepOutcome { delta, finished: true });
        }
        let mut tokens = Vec::with_capacity(1 + proposal.len());
        tokens.push(next);
        tokens.extend_from_slice(&proposal.tokens);
        let rows = if proposal.is_empty() {
            LogitsRows::Last
        } else {
            LogitsRows::All
        };
        self.draft = proposal;
        self.pending = Some(StepInput { tokens, rows });
        Ok(StepOutcome { delta, finished: false })
    }

    /// The model drafter's k for this step: the controller's `k`, or 0 while the drafter has
    /// not started and its catch-up on the context does not pay yet
    /// ([`DraftLength::start_pays`], with `room_out` tokens left to generate at most) and
    /// this step is not a probe.
    fn model_k(&mut self, k: usize, room_out: usize) -> usize {
        if !self.deferred || k == 0 {
            return k;
        }
        let Some(d) = self.drafter.as_ref() else {
            return k;
        };
        let catch_up = d.catch_up_tokens(&self.context);
        // A probe (the step after a pause) starts it whatever the estimate says: without a
        // draft its acceptance would never be measured again, and an estimate carried from
        // an earlier request that did not pay would keep it off for good.
        let probe = self.k_ctl.probing();
        if !probe
            && !self
                .k_ctl
                .start_pays(self.deferred_committed, self.deferred_spent, room_out, catch_up)
        {
            return 0;
        }
        self.deferred = false;
        self.stats.spec.model_started_at = Some(self.emitter.tokens().len());
        tracing::debug!(
            committed = self.emitter.tokens().len(),
            catch_up,
            "model drafter starts"
        );
        k
    }

    /// With n-gram lookup beside a model drafter: look up a draft of up to `room` tokens (every
    /// step, so the lookup learns its match classes' acceptance from every committed token,
    /// verified or not: [`NgramDrafter::propose_tokens`]), and return its most profitable
    /// prefix with its acceptance estimates when that prefix predicts at least the speed-up of
    /// this step's model draft of up to `k` tokens (the controller's best estimate, and never
    /// below plain decoding's). A lookup draft costs no drafting, only its verify rows
    /// ([`DraftLength::best_free_prefix`]). Whichever is chosen, the target decides every
    /// committed token.
    fn lookup_draft(&mut self, k: usize, room: usize) -> Option<(Vec<u32>, Vec<f64>)> {
        let lookup = self.lookup.as_mut()?;
        let t = Instant::now();
        let draft = lookup.propose_tokens(&self.context, room);
        let alphas = lookup.pending_alphas();
        self.stats.spec.draft_s += t.elapsed().as_secs_f64();
        if self.k_ctl.measuring_one_row() {
            // The controller measures a plain step (the unit of every cost): no draft at all.
            return None;
        }
        let (n, lookup_speedup) = self.k_ctl.best_free_prefix(&alphas);
        // The model drafter's best predicted step with at most k tokens (k already holds the
        // room left), or plain decoding.
        let model = self.k_ctl.best_up_to(k).1.max(self.k_ctl.plain_speedup());
        // On a tie the free draft wins. (At a request's first step the two do not tie: the
        // controller's prior for the model drafter's first token is 0.625, the lookup's 0.5.)
        (n > 0 && lookup_speedup >= model).then(|| (draft[..n].to_vec(), alphas[..n].to_vec()))
    }
}

/// The [`DraftGuide`] of one draft step: the controller's `go_on` when its calibrated
/// confidences drive the draft length, and the request's constraint, which masks each draft row
/// as the verify row at that position will be masked (so a model drafter proposes only what the
/// target can accept; what is committed does not change).
struct StepGuide<'a> {
    ctl: &'a DraftLength,
    confidence_driven: bool,
    constraint: Option<&'a mut (dyn Constraint + 'static)>,
}

impl DraftGuide for StepGuide<'_> {
    fn go_on(&mut self, confidence: &[f32]) -> bool {
        !self.confidence_driven || self.ctl.go_on(confidence)
    }

    fn masks(&self) -> bool {
        self.constraint.as_ref().is_some_and(|c| c.masks_drafts())
    }

    fn mask(&mut self, drafted: &[u32], row: &mut [f32]) -> bool {
        let Some(c) = self.constraint.as_mut() else {
            return false;
        };
        c.mask_after(drafted, row).unwrap_or_else(|e| {
            // The draft goes unmasked (the committed state was not touched: the lookahead runs
            // on a copy); verification decides as always.
            tracing::debug!(error = %e, "draft row not masked");
            false
        })
    }
}
