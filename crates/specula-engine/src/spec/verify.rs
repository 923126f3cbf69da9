//! Verification: the one place where draft tokens are accepted or rejected.

use crate::sampling::{argmax, Sampler};

/// Greedy acceptance (temperature 0, one-hot drafter). `rows[i]` are the target's logits after
/// the committed prefix and the first `i` draft tokens (`rows.len() == draft.len() + 1`).
/// Row i is processed exactly as plain decoding would process it at that position: penalties
/// see every earlier token, draft tokens included, as if committed (`sampler` is updated with
/// each accepted token; the caller must not observe them again).
///
/// Returns the accepted prefix length `a` and the token the target itself chooses after it (the
/// correction at the first mismatch, or the bonus token after a full accept). The committed
/// block is `draft[..a]` followed by that token; it is not yet observed by `sampler`.
pub fn accept_greedy(draft: &[u32], rows: &mut [Vec<f32>], sampler: &mut Sampler) -> (usize, u32) {
    debug_assert_eq!(rows.len(), draft.len() + 1);
    debug_assert!(sampler.params().is_greedy());
    for (i, row) in rows.iter_mut().enumerate() {
        sampler.apply_penalties(row);
        let t = argmax(row);
        match draft.get(i) {
            Some(&d) if d == t => sampler.observe(d),
            _ => return (i, t),
        }
    }
    unreachable!("the last row has no draft token and always returns")
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
        assert_eq!(accept_greedy(&[3, 4, 5], &mut rows, &mut s), (2, 6));
        let mut rows = vec![onehot(8, 3), onehot(8, 4), onehot(8, 5), onehot(8, 1)];
        assert_eq!(
            accept_greedy(&[3, 4, 5], &mut rows, &mut s),
            (3, 1),
            "bonus after a full accept"
        );
        let mut rows = vec![onehot(8, 2)];
        assert_eq!(
            accept_greedy(&[], &mut rows, &mut s),
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
        assert_eq!(accept_greedy(&[3], &mut rows, &mut s), (1, 4));
    }
}
