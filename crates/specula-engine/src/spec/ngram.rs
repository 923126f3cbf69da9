//! n-gram prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; llama.cpp `lookup`): find the
//! longest recent suffix of the context, between `min_n` and `max_n` tokens, that occurred
//! earlier, and propose what followed its most recent earlier occurrence.

use super::{Drafter, Proposal};

/// The n-gram drafter.
#[derive(Debug, Clone)]
pub struct NgramDrafter {
    pub min_n: usize,
    pub max_n: usize,
}

impl Default for NgramDrafter {
    fn default() -> Self {
        Self { min_n: 2, max_n: 4 }
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
    /// The continuation of the most recent earlier occurrence of the longest matching suffix.
    pub fn lookup(&self, context: &[u32], k: usize) -> Vec<u32> {
        let len = context.len();
        if k == 0 {
            return Vec::new();
        }
        for n in (self.min_n.max(1)..=self.max_n).rev() {
            if n >= len {
                continue;
            }
            let suffix = &context[len - n..];
            // Most recent earlier occurrence whose continuation exists.
            for start in (0..len - n).rev() {
                if &context[start..start + n] == suffix {
                    let from = start + n;
                    let to = (from + k).min(len);
                    if to > from {
                        return context[from..to].to_vec();
                    }
                }
            }
        }
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_the_continuation_of_the_longest_match() {
        let d = NgramDrafter { min_n: 1, max_n: 3 };
        // ... 1 2 3 [4 5] ... 1 2 3 -> 4 5
        assert_eq!(d.lookup(&[1, 2, 3, 4, 5, 9, 1, 2, 3], 2), vec![4, 5]);
        // The most recent occurrence wins.
        assert_eq!(d.lookup(&[7, 1, 8, 7, 1, 9, 7, 1], 1), vec![9]);
        // Proposals stop at the end of the context.
        assert_eq!(d.lookup(&[5, 6, 5], 4), vec![6, 5]);
        // No match, nothing proposed.
        assert!(d.lookup(&[1, 2, 3], 4).is_empty());
        assert!(d.lookup(&[1, 2, 1, 2], 0).is_empty());
    }

    #[test]
    fn min_n_is_respected() {
        let d = NgramDrafter { min_n: 2, max_n: 3 };
        assert!(d.lookup(&[1, 5, 2, 1], 2).is_empty(), "a 1-gram match is below min_n");
        assert_eq!(d.lookup(&[1, 5, 2, 1, 5], 2), vec![2, 1]);
    }
}
