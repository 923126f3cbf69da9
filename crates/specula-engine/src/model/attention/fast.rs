//! [`AttnMode::OneChunk`](super::AttnMode::OneChunk) with AVX-512: the same bits as
//! [`super::one_chunk`], in three passes instead of one walk over the keys; and
//! [`AttnMode::TwoPass`](super::AttnMode::TwoPass), the same bits as [`super::two_pass`]
//! (the same scores, then the maximum and the sum 16 lanes at a time and the values in f32).
//!
//! The reference walks the keys once and, per (query, key), computes the score, one `expf`,
//! and the f16 update of the output. Only the last step depends on the previous key, so this
//! path splits the work:
//!
//! 1. **Scores** of 16 keys at a time per query. Each score is `dot_f16`'s tree of operations
//!    (four 16-lane FMA chains over steps of 64, summed `(0 + 2) + (1 + 3)`, then the halving
//!    tree of `_mm512_reduce_add_ps`), carried out on 16 keys together: the per-key trees
//!    become lane-wise adds of shuffled registers (a butterfly), so every key gets exactly its
//!    reference sum.
//! 2. **Weights**: the running maximum is a prefix scan (scalar); every `expf` argument is
//!    known from it, so the exponentials run 8 at a time ([`super::expf::expf8`], glibc's
//!    bits), and the sum `S = fma(S, ms, vs)` follows in key order.
//! 3. **Values**: the f16 accumulators of up to four queries stay in registers while the keys
//!    stream past, `acc = f16(acc · ms)` on a new maximum and `acc = f16(fma(v, vs, acc))`
//!    always. A rescale by exactly 1.0 is skipped, which leaves an f16 value unchanged.
//!
//! `tests::fast_matches_reference_bitwise` compares the two paths on random inputs.

#![cfg(target_arch = "x86_64")]

use super::{expf, Args, State};
use half::f16;
use std::arch::x86_64::*;

/// 16 cached f16 values at `p` as f32 (exact).
#[inline(always)]
unsafe fn load16h(p: *const f16) -> __m512 {
    _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
}

/// Can this path run here (AVX-512F with F16C and FMA) for head dimension `d`?
pub(super) fn usable(d: usize) -> bool {
    static F: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let cpu = *F.get_or_init(|| {
        std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
            && std::env::var("SPECULA_ATTN_AVX512").as_deref() != Ok("0")
    });
    cpu && matches!(d, 64 | 128 | 256)
}

/// One attention task (see [`super::one_chunk`]); `d` is 64, 128 or 256 ([`usable`]).
///
/// # Safety
/// [`usable`] returned true for `a.s.head_dim`, and `a.kv` holds heads of `a.s.head_dim`
/// values (checked by the caller, `attend_with`).
pub(super) unsafe fn one_chunk(a: &Args<'_>, st: &mut State) {
    match a.s.head_dim {
        64 => run::<4>(a, st),
        128 => run::<8>(a, st),
        256 => run::<16>(a, st),
        d => unreachable!("fast attention for head_dim {d}"),
    }
}

/// Keys per score tile.
const TILE: usize = 16;

/// The first key of the tile holding the first key a row at `pos` sees.
#[inline(always)]
fn first_tile(s: &super::AttnShape, pos: usize) -> usize {
    s.first_key(pos) / TILE * TILE
}

/// For a windowed row at `pos`: its score row's entries before its window's tile set to 0 (a
/// zero weight for the values pass) and those from the tile to the window's first key to -inf
/// (a zero weight after `expf`), so the tiles from [`first_tile`] on give the bits of skipping
/// the keys outside the window.
#[inline(always)]
fn mask_before_window(s: &super::AttnShape, pos: usize, row: &mut [f32]) {
    let (t, lo) = (first_tile(s, pos), s.first_key(pos));
    row[..t].fill(0.0);
    row[t..lo].fill(f32::NEG_INFINITY);
}
const _: () = assert!(crate::kv_cache::KV_BLOCK.is_multiple_of(TILE));

/// Scaled scores of the task's queries, `[nq, stride]` (`stride` = the keys of the block's last
/// row rounded up to [`TILE`]; entries past a query's keys are unspecified): 16 keys at a time
/// through [`scores16`].
#[inline(always)]
unsafe fn scores<const NV: usize>(a: &Args<'_>, stride: usize) -> Vec<f32> {
    let Args {
        qs,
        kv,
        s,
        g,
        r0,
        nr,
        nh,
    } = *a;
    let d = 16 * NV;
    let nq = nr * nh;
    let lmax = s.start + r0 + nr;
    let len = |i: usize| s.start + r0 + i / nh + 1;
    let scale = s.scale;
    let mut sc = vec![0f32; nq * stride];
    // The tile's keys widened to f32 once (exact), `[TILE, d]`, for all the task's queries;
    // keys past the end stay zero. Tiles before the first row's window are not scored.
    let mut kf = vec![0f32; TILE * d];
    for j0 in (first_tile(s, s.start + r0)..lmax).step_by(TILE) {
        let nk = TILE.min(lmax - j0);
        let (keys, _, end) = kv.head_run(g, j0, j0 + nk);
        // A tile never spans two KV blocks (KV_BLOCK is a multiple of TILE), so the run holds
        // the tile's keys; the raw loads below rely on it.
        assert_eq!(end, j0 + nk, "attention: a key tile crosses a KV block");
        for t in 0..nk {
            let kp = keys[t * d..][..d].as_ptr();
            for c in 0..NV {
                _mm512_storeu_ps(kf.as_mut_ptr().add(t * d + 16 * c), load16h(kp.add(16 * c)));
            }
        }
        if nk < TILE {
            kf[nk * d..].fill(0.0);
        }
        for i in 0..nq {
            if j0 >= len(i) {
                continue;
            }
            let q = qs[i * d..][..d].as_ptr();
            let r = scores16::<NV>(q, kf.as_ptr());
            _mm512_storeu_ps(
                sc.as_mut_ptr().add(i * stride + j0),
                _mm512_mul_ps(r, _mm512_set1_ps(scale)),
            );
        }
    }
    sc
}

/// [`AttnMode::TwoPass`](super::AttnMode::TwoPass) for one task (see [`super::two_pass`]);
/// `d` is 64, 128 or 256 ([`usable`]).
///
/// # Safety
/// [`usable`] returned true for `a.s.head_dim`, and `a.kv` holds heads of `a.s.head_dim`
/// values (checked by the caller, `attend_with`).
pub(super) unsafe fn two_pass(a: &Args<'_>, st: &mut State) {
    match a.s.head_dim {
        64 => two::<4>(a, st),
        128 => two::<8>(a, st),
        256 => two::<16>(a, st),
        d => unreachable!("fast attention for head_dim {d}"),
    }
}

/// [`super::expf`] of 16 lanes (two [`expf::expf8`]).
#[inline(always)]
unsafe fn expf16(x: __m512) -> __m512 {
    let lo = expf::expf8(_mm512_castps512_ps256(x));
    let hi = expf::expf8(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(x))));
    _mm512_castpd_ps(_mm512_insertf64x4::<1>(
        _mm512_castpd256_pd512(_mm256_castps_pd(lo)),
        _mm256_castps_pd(hi),
    ))
}

#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn two<const NV: usize>(a: &Args<'_>, st: &mut State) {
    let (s, nh, nr, r0) = (a.s, a.nh, a.nr, a.r0);
    let d = 16 * NV;
    let nq = nr * nh;
    let lmax = s.start + r0 + nr;
    let len = |i: usize| s.start + r0 + i / nh + 1;
    let stride = lmax.next_multiple_of(TILE);
    // 1. Scores, then in place the weights e_j = expf(s_j - M) (zero past the query's keys and
    // before its window).
    let mut e = scores::<NV>(a, stride);
    for i in 0..nq {
        let n = len(i);
        mask_before_window(s, n - 1, &mut e[i * stride..][..stride]);
        let t_lo = first_tile(s, n - 1) / TILE;
        let row = e.as_mut_ptr().add(i * stride);
        let tiles = n.div_ceil(TILE);
        let mask = |t: usize| -> __mmask16 {
            let rem = n - TILE * t;
            if rem >= TILE {
                0xffff
            } else {
                ((1u32 << rem) - 1) as __mmask16
            }
        };
        // The maximum in 16 lanes by key index, then lane by lane: `x > m ? x : m` throughout.
        let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut mv = ninf;
        for t in t_lo..tiles {
            let x = _mm512_mask_loadu_ps(ninf, mask(t), row.add(TILE * t));
            mv = _mm512_max_ps(x, mv);
        }
        let mut lanes = [0f32; 16];
        _mm512_storeu_ps(lanes.as_mut_ptr(), mv);
        let m = lanes.iter().fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
        let mm = _mm512_set1_ps(m);
        let mut sv = _mm512_setzero_ps();
        for t in t_lo..tiles {
            let k = mask(t);
            let x = _mm512_maskz_loadu_ps(k, row.add(TILE * t));
            let w = _mm512_maskz_mov_ps(k, expf16(_mm512_sub_ps(x, mm)));
            _mm512_storeu_ps(row.add(TILE * t), w);
            sv = _mm512_add_ps(sv, w);
        }
        _mm512_storeu_ps(lanes.as_mut_ptr(), sv);
        st.sum[i] = super::reduce16(&lanes);
    }
    // 2. Values, up to 4 (d = 64) or 2 (d >= 128) queries at a time over their common keys,
    // then each query's own last keys.
    let qc = if NV == 4 { 4 } else { 2 };
    let mut i0 = 0;
    while i0 < nq {
        let n = qc.min(nq - i0);
        let out = &mut st.out[i0 * d..][..n * d];
        let common = len(i0);
        // The chunk's first query has the earliest window; the others' weights are zero
        // before theirs.
        let from = first_tile(s, common - 1);
        let w = |q: usize| e.as_ptr().add((i0 + q) * stride);
        match n {
            4 => values_f32::<NV, 4>(a, out, [w(0), w(1), w(2), w(3)], from, common),
            3 => values_f32::<NV, 3>(a, out, [w(0), w(1), w(2)], from, common),
            2 => values_f32::<NV, 2>(a, out, [w(0), w(1)], from, common),
            _ => values_f32::<NV, 1>(a, out, [w(0)], from, common),
        }
        for q in 0..n {
            let end = len(i0 + q);
            if end > common {
                values_f32::<NV, 1>(a, &mut out[q * d..][..d], [w(q)], common, end);
            }
        }
        i0 += n;
    }
}

/// Keys `j0 .. j1` into the f32 accumulators `out` (`[QC, 16 * NV]`, read and written) of `QC`
/// queries with weights `w`: `acc = fma(v_j, w_j, acc)` in key order.
#[inline(never)]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn values_f32<const NV: usize, const QC: usize>(
    a: &Args<'_>,
    out: &mut [f32],
    w: [*const f32; QC],
    j0: usize,
    j1: usize,
) {
    let d = 16 * NV;
    let mut acc = [[_mm512_setzero_ps(); NV]; QC];
    for (q, regs) in acc.iter_mut().enumerate() {
        for (c, r) in regs.iter_mut().enumerate() {
            *r = _mm512_loadu_ps(out.as_ptr().add(q * d + 16 * c));
        }
    }
    let mut j = j0;
    while j < j1 {
        let (_, values, end) = a.kv.head_run(a.g, j, j1);
        for (jj, row) in (j..end).zip(values.chunks_exact(d)) {
            let vp = row.as_ptr();
            let mut v = [_mm512_setzero_ps(); NV];
            for (c, r) in v.iter_mut().enumerate() {
                *r = load16h(vp.add(16 * c));
            }
            for (q, regs) in acc.iter_mut().enumerate() {
                let wv = _mm512_set1_ps(*w[q].add(jj));
                for (r, x) in regs.iter_mut().zip(&v) {
                    *r = _mm512_fmadd_ps(*x, wv, *r);
                }
            }
        }
        j = end;
    }
    for (q, regs) in acc.iter().enumerate() {
        for (c, r) in regs.iter().enumerate() {
            _mm512_storeu_ps(out.as_mut_ptr().add(q * d + 16 * c), *r);
        }
    }
}

/// `NV` 16-lane registers per head (`head_dim = 16 * NV`).
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn run<const NV: usize>(a: &Args<'_>, st: &mut State) {
    let (s, r0, nr, nh) = (a.s, a.r0, a.nr, a.nh);
    let d = 16 * NV;
    let nq = nr * nh;
    let lmax = s.start + r0 + nr;
    // Keys visible to query i (row i / nh of the block).
    let len = |i: usize| s.start + r0 + i / nh + 1;
    let stride = lmax.next_multiple_of(TILE);

    // 1. Scores, `[nq, stride]`.
    let mut sc = scores::<NV>(a, stride);

    // 2. Weights: `ms` (the rescale of the accumulator) and `vs` (the key's weight) per key.
    let mut ms = vec![1f32; nq * stride];
    let mut vs = vec![0f32; nq * stride];
    for i in 0..nq {
        let n = len(i);
        // Keys before the row's window are skipped: `ms = 1`, `vs = 0` leave the accumulator
        // and the sum as they are.
        let lo = s.first_key(n - 1);
        let row = &mut sc[i * stride..][..stride];
        let new_max = &mut ms[i * stride..][..stride]; // 0.0 marks a new maximum, for now
        let mut m = f32::NEG_INFINITY;
        for (x, nm) in row[lo..n].iter_mut().zip(new_max[lo..].iter_mut()) {
            let v = *x;
            if v > m {
                *x = m - v;
                *nm = 0.0;
                m = v;
            } else {
                *x = v - m;
            }
        }
        let w = &mut vs[i * stride..][..stride];
        for (c, o) in row.chunks_exact(8).zip(w.chunks_exact_mut(8)) {
            _mm256_storeu_ps(o.as_mut_ptr(), expf::expf8(_mm256_loadu_ps(c.as_ptr())));
        }
        for (nm, e) in new_max[lo..n].iter_mut().zip(w[lo..n].iter_mut()) {
            if *nm == 0.0 {
                *nm = *e;
                *e = 1.0;
            }
        }
        w[..lo].fill(0.0);
    }

    // 3. Values and the sums, up to 4 (d = 64) or 2 (d >= 128) queries at a time.
    let qc = if NV == 4 { 4 } else { 2 };
    let mut i0 = 0;
    while i0 < nq {
        let n = qc.min(nq - i0);
        let out = &mut st.out[i0 * d..][..n * d];
        let sums = &mut st.sum[i0..i0 + n];
        let common = len(i0); // the first query of the chunk sees the fewest keys
        let from = s.first_key(common - 1); // and the earliest window
        let w = |q: usize| (ms.as_ptr().add((i0 + q) * stride), vs.as_ptr().add((i0 + q) * stride));
        match n {
            4 => values::<NV, 4>(a, out, sums, [w(0), w(1), w(2), w(3)], from, common),
            3 => values::<NV, 3>(a, out, sums, [w(0), w(1), w(2)], from, common),
            2 => values::<NV, 2>(a, out, sums, [w(0), w(1)], from, common),
            _ => values::<NV, 1>(a, out, sums, [w(0)], from, common),
        }
        for q in 0..n {
            let end = len(i0 + q);
            if end > common {
                values::<NV, 1>(a, &mut out[q * d..][..d], &mut sums[q..q + 1], [w(q)], common, end);
            }
        }
        i0 += n;
    }
}

/// Round each lane to f16 and back (`_mm512_cvtps_ph` with round-to-nearest-even).
#[inline(always)]
unsafe fn f16r(x: __m512) -> __m512 {
    _mm512_cvtph_ps(_mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x))
}

/// Keys `j0 .. j1` into the f16 accumulators `out` (`[QC, 16 * NV]`) and the sums `sums`
/// (`[QC]`, `S = fma(S, ms, vs)`) of `QC` queries, whose `(ms, vs)` rows are `w`; both read and
/// written. The sums' FMA chains run beside the vector work instead of after it.
#[inline(never)]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn values<const NV: usize, const QC: usize>(
    a: &Args<'_>,
    out: &mut [f32],
    sums: &mut [f32],
    w: [(*const f32, *const f32); QC],
    j0: usize,
    j1: usize,
) {
    let d = 16 * NV;
    let mut acc = [[_mm512_setzero_ps(); NV]; QC];
    let mut sum = [0f32; QC];
    for (q, regs) in acc.iter_mut().enumerate() {
        for (c, r) in regs.iter_mut().enumerate() {
            *r = _mm512_loadu_ps(out.as_ptr().add(q * d + 16 * c));
        }
        sum[q] = sums[q];
    }
    // Keys where some query of the chunk has a new maximum (`ms != 1`) are rare: they take a
    // step that rescales every query (by exactly 1.0 where it has none: no change to an f16
    // value), so the common step has no branch and the accumulators stay in registers.
    let mut j = j0;
    while j < j1 {
        let (_, values, end) = a.kv.head_run(a.g, j, j1);
        for (jj, row) in (j..end).zip(values.chunks_exact(d)) {
            let vp = row.as_ptr();
            let mut v = [_mm512_setzero_ps(); NV];
            for (c, r) in v.iter_mut().enumerate() {
                *r = load16h(vp.add(16 * c));
            }
            let mut rescale = false;
            for wq in &w {
                rescale |= *wq.0.add(jj) != 1.0;
            }
            if rescale {
                for (q, regs) in acc.iter_mut().enumerate() {
                    let mv = _mm512_set1_ps(*w[q].0.add(jj));
                    for r in regs.iter_mut() {
                        *r = f16r(_mm512_mul_ps(*r, mv));
                    }
                }
            }
            for (q, regs) in acc.iter_mut().enumerate() {
                let vs = *w[q].1.add(jj);
                let wv = _mm512_set1_ps(vs);
                for (r, x) in regs.iter_mut().zip(&v) {
                    *r = f16r(_mm512_fmadd_ps(*x, wv, *r));
                }
                sum[q] = sum[q].mul_add(*w[q].0.add(jj), vs);
            }
        }
        j = end;
    }
    for (q, regs) in acc.iter().enumerate() {
        for (c, r) in regs.iter().enumerate() {
            _mm512_storeu_ps(out.as_mut_ptr().add(q * d + 16 * c), *r);
        }
        sums[q] = sum[q];
    }
}

/// Unscaled `dot_f16(q, k_t)` for the 16 keys at `k` (`[TILE, 16 * NV]` f32, the cached f16
/// keys widened once per tile for all the queries of a task), lane t.
#[inline(always)]
unsafe fn scores16<const NV: usize>(q: *const f32, k: *const f32) -> __m512 {
    let mut qv = [_mm512_setzero_ps(); NV];
    for (c, r) in qv.iter_mut().enumerate() {
        *r = _mm512_loadu_ps(q.add(16 * c));
    }
    // Per key: four accumulators over steps of 64 elements, then (0 + 2) + (1 + 3).
    let mut x = [_mm512_setzero_ps(); TILE];
    for (t, xt) in x.iter_mut().enumerate() {
        let mut acc = [_mm512_setzero_ps(); 4];
        for step in 0..NV / 4 {
            for (j, aj) in acc.iter_mut().enumerate() {
                let c = 4 * step + j;
                *aj = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k.add(t * 16 * NV + 16 * c)), *aj);
            }
        }
        *xt = _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3]));
    }
    // The halving tree of each x[t] (8 + 8, 4 + 4, then (0 + 2) + (1 + 3)), on 16 keys at once.
    // Level 1: keys 2p, 2p+1 → 128-bit lanes [t(2p) lo, t(2p) hi, t(2p+1) lo, t(2p+1) hi].
    let mut t1 = [_mm512_setzero_ps(); 8];
    for (p, o) in t1.iter_mut().enumerate() {
        let (a, b) = (x[2 * p], x[2 * p + 1]);
        let lo = _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b);
        let hi = _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b);
        *o = _mm512_add_ps(lo, hi);
    }
    // Level 2: 128-bit lane j of u[q] holds u(4q + j).
    let mut u = [_mm512_setzero_ps(); 4];
    for (qq, o) in u.iter_mut().enumerate() {
        let (a, b) = (t1[2 * qq], t1[2 * qq + 1]);
        let lo = _mm512_shuffle_f32x4::<0b10_00_10_00>(a, b);
        let hi = _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b);
        *o = _mm512_add_ps(lo, hi);
    }
    // Level 3: lane j of v[s] = [u0+u2, u1+u3 of key 8s + j, the same of key 8s + 4 + j].
    let mut v = [_mm512_setzero_ps(); 2];
    for (ss, o) in v.iter_mut().enumerate() {
        let (a, b) = (u[2 * ss], u[2 * ss + 1]);
        let lo = _mm512_shuffle_ps::<0b01_00_01_00>(a, b);
        let hi = _mm512_shuffle_ps::<0b11_10_11_10>(a, b);
        *o = _mm512_add_ps(lo, hi);
    }
    // Level 4: element 4j + e holds key 4e + j.
    let lo = _mm512_shuffle_ps::<0b10_00_10_00>(v[0], v[1]);
    let hi = _mm512_shuffle_ps::<0b11_01_11_01>(v[0], v[1]);
    let r = _mm512_add_ps(lo, hi);
    // Back to key order: lane t takes element 4 (t % 4) + t / 4.
    let idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_permutexvar_ps(idx, r)
}
