//! Specula's own CPU kernels: the products whose reduction order the exactness promise depends on.

pub mod kquants;
pub mod qmatmul;

use rayon::prelude::*;

/// Schedule a row-wise product `y[i, j] = f(weight row j, activation row i)` for `n` weight rows
/// (of `k` inputs each) and `xs.len()` activation rows; returns `y` as `[m, n]` row-major.
///
/// `dot(j, rows, out)` computes `out[r] = f(j, rows[r])` for a group of 1..=`group` activation
/// rows (a micro-kernel that shares the unpacking of weight row `j` between them); it must give
/// bitwise the same value for a row whatever group it is computed in, which is what makes the
/// product batch-invariant (the grouping depends on `m`). Weight rows are split into chunks
/// over the rayon pool; inside a chunk, tiles of 16 weight rows stay in cache across all
/// activation rows.
pub(crate) fn run_rows<X: Sync>(
    n: usize,
    k: usize,
    xs: &[X],
    group: usize,
    dot: impl Fn(usize, &[&X], &mut [f32]) + Sync,
) -> Vec<f32> {
    let m = xs.len();
    let mut out_t = vec![0f32; n * m];
    if m == 0 || n == 0 {
        return out_t;
    }
    let refs: Vec<&X> = xs.iter().collect();
    let group = group.max(1);
    const TILE: usize = 16;
    let threads = rayon::current_num_threads().max(1);
    let per_chunk = n.div_ceil(threads * 4).next_multiple_of(TILE).max(TILE);
    let work = |(c, chunk): (usize, &mut [f32])| {
        let j0 = c * per_chunk;
        let rows_here = chunk.len() / m;
        let mut y = vec![0f32; group];
        for t0 in (0..rows_here).step_by(TILE) {
            let t1 = (t0 + TILE).min(rows_here);
            for i in (0..m).step_by(group) {
                let g = group.min(m - i);
                for jj in t0..t1 {
                    dot(j0 + jj, &refs[i..i + g], &mut y[..g]);
                    chunk[jj * m + i..jj * m + i + g].copy_from_slice(&y[..g]);
                }
            }
        }
    };
    if n * k * m >= 1 << 15 {
        out_t.par_chunks_mut(per_chunk * m).enumerate().for_each(work);
    } else {
        out_t.chunks_mut(per_chunk * m).enumerate().for_each(work);
    }
    transpose(&out_t, n, m)
}

/// `[n, m]` row-major → `[m, n]` row-major (in 32 × 32 tiles, to stay in cache).
pub(crate) fn transpose(t: &[f32], n: usize, m: usize) -> Vec<f32> {
    const B: usize = 32;
    let mut out = vec![0f32; m * n];
    for j0 in (0..n).step_by(B) {
        for i0 in (0..m).step_by(B) {
            for j in j0..(j0 + B).min(n) {
                for i in i0..(i0 + B).min(m) {
                    out[i * n + j] = t[j * m + i];
                }
            }
        }
    }
    out
}
