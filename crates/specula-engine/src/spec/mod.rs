//! Speculative decoding: drafters propose tokens, the target verifies them in one forward pass,
//! and only what plain decoding would have produced is committed.
//!
//! This first cut covers greedy requests with deterministic drafters (n-gram prompt lookup):
//! the drafter's distribution q is one-hot, so acceptance is the greedy rule of
//! [`verify::accept_greedy`]. Exactness rests on the target's verify rows being bitwise equal to
//! one-row decode rows ([`crate::model::Model::batch_invariant`]); a model whose kernels are not
//! invariant decodes plain AR and says so in its stats.

pub mod ngram;
pub mod verify;

use serde::{Deserialize, Serialize};

/// Which drafter a request uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SpecMode {
    /// Plain autoregressive decoding.
    #[default]
    Off,
    /// n-gram prompt lookup (no model, no cost).
    Ngram,
}

/// Speculation settings of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpecOptions {
    pub mode: SpecMode,
    /// Maximum draft length k per target step (>= 1).
    pub draft_max: usize,
    /// Choose k per step from recent acceptance (else always `draft_max` when a draft exists).
    pub adaptive: bool,
}

impl Default for SpecOptions {
    fn default() -> Self {
        Self {
            mode: SpecMode::Off,
            draft_max: 4,
            adaptive: true,
        }
    }
}

/// A drafter that proposes tokens deterministically (its q is one-hot on each proposal).
pub trait Drafter {
    /// Propose up to `k` tokens continuing `context` (prompt + committed tokens). May return
    /// fewer, or none.
    fn propose(&mut self, context: &[u32], k: usize) -> Vec<u32>;
    /// Told after verification how many of the last proposal were accepted (for drafters that
    /// keep state to roll back).
    fn accepted(&mut self, _n: usize) {}
    /// A short name for stats and logs.
    fn name(&self) -> &'static str;
}

/// Per-request speculation counters.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SpecStats {
    /// "ar", or the drafter's name; with the reason when speculation was asked for but not used.
    pub decode_path: String,
    /// Draft tokens proposed.
    pub drafted: usize,
    /// Draft tokens accepted.
    pub accepted: usize,
    /// Target forward passes after prefill.
    pub target_steps: usize,
    /// Tokens committed by those steps.
    pub committed: usize,
    /// Accepted count per draft position (index 0 = first draft token).
    pub accepted_by_position: Vec<usize>,
    /// Drafted count per draft position.
    pub drafted_by_position: Vec<usize>,
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

/// Draft-length controller: k follows an exponential moving average (EMA) of the accepted
/// length, one more than what recent steps accepted, within `1..=draft_max`. When the EMA falls
/// below half a token per step, drafting pauses for a number of steps that doubles on each
/// consecutive failure (up to 32) and resets after a step that accepts something: a verify of
/// k+1 rows costs more than a decode step, so drafts that keep failing make decoding slower.
#[derive(Debug, Clone)]
pub struct DraftLength {
    max: usize,
    adaptive: bool,
    ema: f64,
    pause: usize,
    backoff: usize,
}

impl DraftLength {
    pub fn new(max: usize, adaptive: bool) -> Self {
        Self {
            max: max.max(1),
            adaptive,
            ema: max.max(1) as f64,
            pause: 0,
            backoff: 1,
        }
    }

    /// The k for the next step (0 = do not draft this step).
    pub fn next_k(&mut self) -> usize {
        if !self.adaptive {
            return self.max;
        }
        if self.pause > 0 {
            self.pause -= 1;
            return 0;
        }
        ((self.ema + 1.0).round() as usize).clamp(1, self.max)
    }

    /// Feed the accepted length of a step that drafted.
    pub fn update(&mut self, accepted: usize) {
        self.ema = 0.7 * self.ema + 0.3 * accepted as f64;
        if !self.adaptive {
            return;
        }
        if accepted > 0 {
            self.backoff = 1;
        }
        if self.ema < 0.5 {
            self.pause = self.backoff;
            self.backoff = (self.backoff * 2).min(32);
            self.ema = 1.0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draft_length_follows_acceptance_and_backs_off() {
        let mut c = DraftLength::new(8, true);
        assert_eq!(c.next_k(), 8);
        for _ in 0..10 {
            c.update(8);
        }
        assert_eq!(c.next_k(), 8);
        for _ in 0..3 {
            c.update(1);
        }
        assert!(c.next_k() < 8);
        // Failures pause drafting, longer each time.
        let mut paused = Vec::new();
        for _ in 0..4 {
            while c.next_k() != 0 {
                c.update(0);
            }
            let mut n = 1;
            while c.next_k() == 0 {
                n += 1;
            }
            paused.push(n);
            c.update(0);
        }
        assert!(paused.windows(2).all(|w| w[1] >= w[0]), "{paused:?}");
        assert!(paused[3] > paused[0], "{paused:?}");
        let mut fixed = DraftLength::new(3, false);
        fixed.update(0);
        assert_eq!(fixed.next_k(), 3);
    }
}
