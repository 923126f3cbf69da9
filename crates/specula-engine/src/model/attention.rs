//! Causal grouped-query attention over a KV cache, computed row by row.
//!
//! Each (query row, head) pair is reduced over exactly the keys at positions `0..=pos` in
//! ascending order, with fixed 8-lane partial sums, independent of how many rows are computed
//! together. A verify row at position p therefore gets the bits a one-row decode step at p
//! gets (the batch-invariance Specula's exactness needs; see DESIGN.md). Softmax is the
//! standard max-subtracted form (scaled dot-product attention, Vaswani et al. 2017).

use rayon::prelude::*;

/// Shape of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    /// Query rows `n`; row r sits at absolute position `start + r`.
    pub rows: usize,
    pub start: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// Dot product with 8 independent lanes summed in a fixed order.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `q`: `[rows, num_heads, head_dim]`; `keys`, `values`: `[positions, num_kv_heads, head_dim]`
/// holding at least `start + rows` positions. Returns `[rows, num_heads, head_dim]` f32.
pub fn attend(q: &[f32], keys: &[f32], values: &[f32], s: &AttnShape) -> Vec<f32> {
    let d = s.head_dim;
    let group = s.num_heads / s.num_kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    let mut out = vec![0f32; s.rows * s.num_heads * d];
    let work = |(idx, o): (usize, &mut [f32])| {
        let (r, h) = (idx / s.num_heads, idx % s.num_heads);
        let g = h / group;
        let qv = &q[idx * d..(idx + 1) * d];
        let len = s.start + r + 1;
        let mut scores = Vec::with_capacity(len);
        let mut max = f32::NEG_INFINITY;
        for j in 0..len {
            let kj = &keys[(j * s.num_kv_heads + g) * d..][..d];
            let sc = dot(qv, kj) * scale;
            max = max.max(sc);
            scores.push(sc);
        }
        let mut sum = 0f32;
        for sc in scores.iter_mut() {
            *sc = (*sc - max).exp();
            sum += *sc;
        }
        let inv = 1.0 / sum;
        for (j, &p) in scores.iter().enumerate() {
            let vj = &values[(j * s.num_kv_heads + g) * d..][..d];
            let w = p * inv;
            for (oi, &vi) in o.iter_mut().zip(vj) {
                *oi += w * vi;
            }
        }
    };
    let total_keys = s.rows * (s.start + s.rows);
    if total_keys * s.num_heads * d < 1 << 16 {
        out.chunks_mut(d).enumerate().for_each(work);
    } else {
        out.par_chunks_mut(d).enumerate().for_each(work);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pseudo(n: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2654435761).wrapping_add(12345);
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x % 2000) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn rows_match_single_row_bitwise() {
        let (h, kvh, d, pos) = (4, 2, 16, 40);
        let keys = pseudo(pos * kvh * d, 1);
        let values = pseudo(pos * kvh * d, 2);
        let rows = 9;
        let start = pos - rows;
        let q = pseudo(rows * h * d, 3);
        let many = attend(
            &q,
            &keys,
            &values,
            &AttnShape {
                rows,
                start,
                num_heads: h,
                num_kv_heads: kvh,
                head_dim: d,
            },
        );
        for r in 0..rows {
            let one = attend(
                &q[r * h * d..(r + 1) * h * d],
                &keys,
                &values,
                &AttnShape {
                    rows: 1,
                    start: start + r,
                    num_heads: h,
                    num_kv_heads: kvh,
                    head_dim: d,
                },
            );
            assert_eq!(
                many[r * h * d..(r + 1) * h * d]
                    .iter()
                    .map(|x| x.to_bits())
                    .collect::<Vec<_>>(),
                one.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "row {r}"
            );
        }
    }

    #[test]
    fn matches_naive_softmax_attention() {
        let (h, kvh, d, rows) = (2, 1, 8, 3);
        let keys = pseudo(rows * kvh * d, 4);
        let values = pseudo(rows * kvh * d, 5);
        let q = pseudo(rows * h * d, 6);
        let out = attend(
            &q,
            &keys,
            &values,
            &AttnShape {
                rows,
                start: 0,
                num_heads: h,
                num_kv_heads: kvh,
                head_dim: d,
            },
        );
        for r in 0..rows {
            for hh in 0..h {
                let qv = &q[(r * h + hh) * d..][..d];
                let sc: Vec<f64> = (0..=r)
                    .map(|j| {
                        qv.iter()
                            .zip(&keys[j * d..(j + 1) * d])
                            .map(|(a, b)| (*a * *b) as f64)
                            .sum::<f64>()
                            / (d as f64).sqrt()
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = sc.iter().map(|s| (s - m).exp()).sum();
                for i in 0..d {
                    let want: f64 = (0..=r).map(|j| (sc[j] - m).exp() / z * values[j * d + i] as f64).sum();
                    let got = out[(r * h + hh) * d + i] as f64;
                    assert!((want - got).abs() < 1e-5, "r{r} h{hh} i{i}: {want} vs {got}");
                }
            }
        }
    }
}
