//! n-gram prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; llama.cpp `lookup`): find the
//! longest recent suffix of the context, between `min_n` and `max_n` tokens, that occurred
//! earlier, and propose what followed its most recent earlier occurrence.
//!
//! **Structural matches.** Lists, tables, JSON arrays and SQL rows repeat their structure with
//! different numbers in it (`{"id": 7, "name": "user_7"}` after `{"id": 6, "name": "user_6"}`),
//! and the tokenizers of the catalog split numbers into digits, so right after a new number no
//! exact suffix matches and lookup proposes nothing where the rest of the line is predictable.
//! When the drafter knows which tokens spell numbers ([`NgramDrafter::number_classes`]), it
//! also matches with every number token equal to every other of its class (digits, or space +
//! digits), and takes that match when it is strictly longer than the longest exact one. The
//! proposal is still the literal continuation of the earlier occurrence, so a wrong number in
//! it is simply rejected by verification: the drafter only ever changes speed, never output.
//! Measured on the shared prompts (`scripts/spec_bench.py`): see `docs/perf.md`.

use super::{Drafter, Proposal};
use crate::tokenizer::NUMBER_NONE;
use std::sync::Arc;

/// The n-gram drafter.
#[derive(Debug, Clone)]
pub struct NgramDrafter {
    /// Shortest suffix (tokens) that counts as a match; at least 1.
    pub min_n: usize,
    /// Longest suffix (tokens) compared; longer matches count as `max_n`.
    pub max_n: usize,
    /// Number class per token id ([`crate::tokenizer::Tokenizer::number_classes`]); empty:
    /// exact matches only.
    pub number_classes: Arc<[u8]>,
}

impl Default for NgramDrafter {
    fn default() -> Self {
        Self {
            min_n: 2,
            max_n: 4,
            number_classes: Arc::from(Vec::new()),
        }
    }
}

impl Drafter for NgramDrafter {
    fn propose(&mut self, context: &[u32], k: usize) -> anyhow::Result<Proposal> {
        Ok(Proposal::deterministic(self.lookup(context, k)))
    }

    fn name(&self) -> &'static str {
        "ngram"
    }
}

impl NgramDrafter {
    /// Exact matches only, `min_n ..= max_n` tokens.
    pub fn new(min_n: usize, max_n: usize) -> Self {
        Self {
            min_n,
            max_n,
            ..Self::default()
        }
    }

    /// With structural matches over these number classes (index = token id).
    pub fn with_number_classes(mut self, classes: Arc<[u8]>) -> Self {
        self.number_classes = classes;
        self
    }

    fn class(&self, t: u32) -> u8 {
        self.number_classes.get(t as usize).copied().unwrap_or(NUMBER_NONE)
    }

    /// Up to `k` tokens: the continuation of the most recent earlier occurrence of the longest
    /// suffix of `context` that occurred before (at least `min_n`, at most `max_n` tokens), or
    /// of the longest structural match when that is strictly longer (see the module docs).
    /// Empty when nothing matches. One backward scan, O(len · matched length).
    pub fn lookup(&self, context: &[u32], k: usize) -> Vec<u32> {
        let len = context.len();
        let max_n = self.max_n.min(len.saturating_sub(1));
        let min_n = self.min_n.max(1);
        if k == 0 || max_n < min_n {
            return Vec::new();
        }
        let structural = !self.number_classes.is_empty();
        let last = len - 1;
        // (matched length, end of the occurrence) of the best exact and structural matches.
        let (mut exact, mut shape) = ((0usize, 0usize), (0usize, 0usize));
        // `end` is the last token of a candidate occurrence; its continuation starts at end + 1.
        for end in (0..last).rev() {
            let reach = max_n.min(end + 1);
            let mut j = 0;
            while j < reach && context[end - j] == context[last - j] {
                j += 1;
            }
            if j > exact.0 {
                exact = (j, end);
                if j == max_n {
                    break; // Nothing can be longer; the most recent longest wins.
                }
            }
            if structural && reach > shape.0.max(exact.0) {
                let mut s = j;
                while s < reach && {
                    let (a, b) = (context[end - s], context[last - s]);
                    let ca = self.class(a);
                    a == b || (ca != NUMBER_NONE && ca == self.class(b))
                } {
                    s += 1;
                }
                if s > shape.0 {
                    shape = (s, end);
                }
            }
        }
        let (n, end) = if shape.0 > exact.0 { shape } else { exact };
        if n < min_n {
            return Vec::new();
        }
        let from = end + 1;
        context[from..(from + k).min(len)].to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::{NUMBER_DIGITS, NUMBER_SPACE_DIGITS};

    #[test]
    fn proposes_the_continuation_of_the_longest_match() {
        let d = NgramDrafter::new(1, 3);
        // ... 1 2 3 [4 5] ... 1 2 3 -> 4 5
        assert_eq!(d.lookup(&[1, 2, 3, 4, 5, 9, 1, 2, 3], 2), vec![4, 5]);
        // The most recent occurrence wins.
        assert_eq!(d.lookup(&[7, 1, 8, 7, 1, 9, 7, 1], 1), vec![9]);
        // The longest match wins over a more recent shorter one.
        assert_eq!(d.lookup(&[6, 7, 1, 8, 5, 7, 1, 9, 2, 6, 7, 1], 1), vec![8]);
        // Proposals stop at the end of the context.
        assert_eq!(d.lookup(&[5, 6, 5], 4), vec![6, 5]);
        // No match, nothing proposed.
        assert!(d.lookup(&[1, 2, 3], 4).is_empty());
        assert!(d.lookup(&[1, 2, 1, 2], 0).is_empty());
        assert!(d.lookup(&[], 3).is_empty());
        assert!(d.lookup(&[4], 3).is_empty());
    }

    #[test]
    fn min_n_is_respected() {
        let d = NgramDrafter::new(2, 3);
        assert!(d.lookup(&[1, 5, 2, 1], 2).is_empty(), "a 1-gram match is below min_n");
        assert_eq!(d.lookup(&[1, 5, 2, 1, 5], 2), vec![2, 1]);
    }

    /// The scan must agree with the definition: for n from max_n down to min_n, the most
    /// recent earlier occurrence of the n-token suffix whose continuation exists.
    #[test]
    fn exact_lookup_matches_the_definition() {
        fn reference(ctx: &[u32], k: usize, min_n: usize, max_n: usize) -> Vec<u32> {
            let len = ctx.len();
            for n in (min_n.max(1)..=max_n).rev() {
                if n >= len {
                    continue;
                }
                for start in (0..len - n).rev() {
                    if ctx[start..start + n] == ctx[len - n..] {
                        let from = start + n;
                        return ctx[from..(from + k).min(len)].to_vec();
                    }
                }
            }
            Vec::new()
        }
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        for case in 0..3000 {
            let len = 1 + case % 40;
            let alphabet = 2 + (case % 5) as u64;
            let ctx: Vec<u32> = (0..len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state % alphabet) as u32
                })
                .collect();
            for (min_n, max_n) in [(1, 3), (2, 4), (2, 8), (3, 3)] {
                let k = 1 + case % 6;
                assert_eq!(
                    NgramDrafter::new(min_n, max_n).lookup(&ctx, k),
                    reference(&ctx, k, min_n, max_n),
                    "{ctx:?} k={k} n={min_n}..={max_n}"
                );
            }
        }
    }

    /// Tokens 10..=19 are digits, 20..=29 space + digit; 1.. are structure.
    fn classes() -> Arc<[u8]> {
        let mut c = vec![NUMBER_NONE; 32];
        c[10..20].fill(NUMBER_DIGITS);
        c[20..30].fill(NUMBER_SPACE_DIGITS);
        c.into()
    }

    #[test]
    fn a_new_number_matches_the_structure_around_an_earlier_one() {
        let d = NgramDrafter::new(2, 4).with_number_classes(classes());
        // `{ id : 16 , name : 16 } {` then `id : 17`: no exact 2-gram ends in 17, the
        // structural match proposes what followed the earlier number.
        let ctx = [1, 2, 3, 11, 16, 4, 5, 3, 11, 16, 6, 1, 2, 3, 11, 17];
        assert_eq!(d.lookup(&ctx, 3), vec![4, 5, 3]);
        assert!(NgramDrafter::new(2, 4).lookup(&ctx, 3).is_empty(), "no exact match");
        // A number of another class (space + digit) does not match a digit.
        let ctx = [1, 2, 3, 11, 16, 4, 5, 3, 21, 26, 6, 1, 2, 3, 11, 27];
        assert!(d.lookup(&ctx, 3).is_empty());
    }

    #[test]
    fn an_exact_match_wins_unless_the_structural_one_is_longer() {
        let d = NgramDrafter::new(2, 4).with_number_classes(classes());
        // Exact 4-gram `5 3 11 16` occurred (continued by 7); a structural match cannot be
        // longer than max_n, so the exact continuation is proposed.
        let ctx = [5, 3, 11, 16, 7, 9, 5, 3, 11, 12, 8, 9, 5, 3, 11, 16];
        assert_eq!(d.lookup(&ctx, 1), vec![7]);
        // Exact match of 2 (`11 16` -> 7); structural match of 4 (`5 3 11 12` -> 8) wins.
        let ctx = [11, 16, 7, 9, 5, 3, 11, 12, 8, 9, 5, 3, 11, 16];
        assert_eq!(NgramDrafter::new(2, 4).lookup(&ctx, 1), vec![7]);
        assert_eq!(d.lookup(&ctx, 1), vec![8]);
        // Non-number tokens never match each other.
        let ctx = [1, 2, 9, 3, 1];
        assert!(d.lookup(&ctx, 1).is_empty());
    }
}
