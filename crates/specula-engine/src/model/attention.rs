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

/// Query rows per attention task: bounds the score buffer of a task to
/// `ROW_BLOCK × group × positions` floats during long prefills.
const ROW_BLOCK: usize = 16;

/// `q`: `[rows, num_heads, head_dim]`; `keys`, `values`: `[positions, num_kv_heads, head_dim]`
/// holding at least `start + rows` positions. Returns `[rows, num_heads, head_dim]` f32.
///
/// Work is split into tasks of (KV head, block of up to [`ROW_BLOCK`] rows). A task walks the
/// keys and values of its KV head once and uses each for every query head of the group and
/// every row of the block (grouped-query attention reads K/V once per group, and a verify block
/// reads them once for all its rows). The arithmetic of each (row, head) is unchanged by this
/// sharing: the same dot products, the same ascending-position max, sum and accumulation.
pub fn attend(q: &[f32], keys: &[f32], values: &[f32], s: &AttnShape) -> Vec<f32> {
    let d = s.head_dim;
    let group = s.num_heads / s.num_kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    let blocks = s.rows.div_ceil(ROW_BLOCK);
    let task = |t: usize| -> Vec<f32> {
        let (g, b) = (t % s.num_kv_heads, t / s.num_kv_heads);
        let r0 = b * ROW_BLOCK;
        let nr = ROW_BLOCK.min(s.rows - r0);
        let len = s.start + r0 + nr; // keys visible to the block's last row
                                     // scores[(r * group + hh) * len + j]
        let mut scores = vec![0f32; nr * group * len];
        let mut max = vec![f32::NEG_INFINITY; nr * group];
        for j in 0..len {
            let kj = &keys[(j * s.num_kv_heads + g) * d..][..d];
            for r in 0..nr {
                if j > s.start + r0 + r {
                    continue;
                }
                for hh in 0..group {
                    let h = g * group + hh;
                    let qv = &q[((r0 + r) * s.num_heads + h) * d..][..d];
                    let sc = dot(qv, kj) * scale;
                    let i = r * group + hh;
                    max[i] = max[i].max(sc);
                    scores[i * len + j] = sc;
                }
            }
        }
        let mut inv = vec![0f32; nr * group];
        for r in 0..nr {
            let visible = s.start + r0 + r + 1;
            for hh in 0..group {
                let i = r * group + hh;
                let mut sum = 0f32;
                for sc in scores[i * len..i * len + visible].iter_mut() {
                    *sc = (*sc - max[i]).exp();
                    sum += *sc;
                }
                inv[i] = 1.0 / sum;
            }
        }
        let mut out = vec![0f32; nr * group * d];
        for j in 0..len {
            let vj = &values[(j * s.num_kv_heads + g) * d..][..d];
            for r in 0..nr {
                if j > s.start + r0 + r {
                    continue;
                }
                for hh in 0..group {
                    let i = r * group + hh;
                    let w = scores[i * len + j] * inv[i];
                    for (oi, &vi) in out[i * d..(i + 1) * d].iter_mut().zip(vj) {
                        *oi += w * vi;
                    }
                }
            }
        }
        out
    };
    let tasks = s.num_kv_heads * blocks;
    let total_keys = s.rows * (s.start + s.rows);
    let parts: Vec<Vec<f32>> = if total_keys * s.num_heads * d < 1 << 16 {
        (0..tasks).map(task).collect()
    } else {
        (0..tasks).into_par_iter().map(task).collect()
    };
    let mut out = vec![0f32; s.rows * s.num_heads * d];
    for (t, part) in parts.iter().enumerate() {
        let (g, b) = (t % s.num_kv_heads, t / s.num_kv_heads);
        let r0 = b * ROW_BLOCK;
        for (ri, rows) in part.chunks(group * d).enumerate() {
            let dst = ((r0 + ri) * s.num_heads + g * group) * d;
            out[dst..dst + group * d].copy_from_slice(rows);
        }
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
        let (h, kvh, d, pos) = (6, 2, 16, 60);
        let keys = pseudo(pos * kvh * d, 1);
        let values = pseudo(pos * kvh * d, 2);
        // 9 rows: one task per KV head; 37 rows: several row blocks per KV head.
        for rows in [9, 37] {
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
