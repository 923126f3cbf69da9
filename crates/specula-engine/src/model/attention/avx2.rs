//! [`AttnMode::TwoPass`](super::AttnMode::TwoPass) with AVX2, FMA and F16C, for CPUs without
//! AVX-512: the same bits as [`super::two_pass`] (and as the AVX-512 path, `super::fast`), in
//! 256-bit registers.
//!
//! 1. **Scores** of 8 keys at a time per query, the keys widened to f32 once per tile for every
//!    query of the task. Each score is `dot_f16`'s tree: four 16-lane FMA chains over steps of
//!    64 (here each 16-lane chain is two 8-lane registers, lane for lane the same operations),
//!    summed `(0 + 2) + (1 + 3)`, then the halving tree of `_mm512_reduce_add_ps` (8 + 8, 4 + 4,
//!    `(0 + 2) + (1 + 3)`), carried out on 8 keys together by a butterfly of shuffles, so every
//!    key gets exactly its reference sum.
//! 2. **Weights**: the maximum and the sum in 16 lanes by key index (two registers), the
//!    exponentials 8 at a time ([`super::expf::expf8_avx2`], glibc's bits).
//! 3. **Values** in f32, `acc = fma(v, w, acc)` in key order, for two queries and 32 columns
//!    of the head at a time, so the accumulators stay in the 16 registers.
//!
//! Before this path, CPUs without AVX-512 ran the portable loop of [`super::two_pass`] (one
//! call per key to widen, dot and accumulate), several times slower at long context.
//! `tests::fast_matches_reference_bitwise` compares this path with the reference bit for bit.

#![cfg(target_arch = "x86_64")]

use super::{expf, Args, State};
use half::f16;
use std::arch::x86_64::*;

/// Keys per score tile.
const TILE: usize = 8;
const _: () = assert!(crate::kv_cache::KV_BLOCK.is_multiple_of(TILE));

/// Lanes of the maximum and the sum (those of [`super::two_pass`]).
const LANES: usize = 16;

/// Can this path run here (AVX2, FMA and F16C) for head dimension `d`? `SPECULA_ATTN_AVX2=0`
/// turns it off (the portable loop then runs).
pub(super) fn usable(d: usize) -> bool {
    static F: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let cpu = *F.get_or_init(|| {
        std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
            && std::env::var("SPECULA_ATTN_AVX2").as_deref() != Ok("0")
    });
    cpu && matches!(d, 64 | 128 | 256)
}

/// 8 cached f16 values at `p` as f32 (exact).
#[inline(always)]
unsafe fn load8h(p: *const f16) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
}

/// [`AttnMode::TwoPass`](super::AttnMode::TwoPass) for one task (see [`super::two_pass`]).
///
/// # Safety
/// [`usable`] returned true for `a.s.head_dim`, and `a.kv` holds heads of `a.s.head_dim`
/// values (checked by the caller, `attend_with`).
pub(super) unsafe fn two_pass(a: &Args<'_>, st: &mut State) {
    match a.s.head_dim {
        64 => two::<4>(a, st),
        128 => two::<8>(a, st),
        256 => two::<16>(a, st),
        d => unreachable!("AVX2 attention for head_dim {d}"),
    }
}

/// `NV` 16-lane groups per head (`head_dim = 16 * NV`).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn two<const NV: usize>(a: &Args<'_>, st: &mut State) {
    let (s, nh, nr, r0) = (a.s, a.nh, a.nr, a.r0);
    let d = 16 * NV;
    let nq = nr * nh;
    let lmax = s.start + r0 + nr;
    let len = |i: usize| s.start + r0 + i / nh + 1;
    let stride = lmax.next_multiple_of(LANES);
    // 1. Scores, then in place the weights e_j = expf(s_j - M) (zero past the query's keys and
    // before its window).
    let mut e = scores::<NV>(a, stride);
    let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
    for i in 0..nq {
        let n = len(i);
        let (t_lo, lo) = (s.first_key(n - 1) / LANES, s.first_key(n - 1));
        // Before the window's tile: zero weights for the values pass; from the tile to the
        // window: -inf scores, zero weights after `expf`.
        e[i * stride..][..LANES * t_lo].fill(0.0);
        e[i * stride..][LANES * t_lo..lo].fill(f32::NEG_INFINITY);
        let row = e.as_mut_ptr().add(i * stride);
        let tiles = n.div_ceil(LANES);
        // The 16 scores of tile t, `fill` past the query's keys.
        let load = |t: usize, fill: f32| -> [__m256; 2] {
            let p = row.add(LANES * t);
            if n >= LANES * (t + 1) {
                [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))]
            } else {
                let mut x = [fill; LANES];
                std::ptr::copy_nonoverlapping(p, x.as_mut_ptr(), n - LANES * t);
                [_mm256_loadu_ps(x.as_ptr()), _mm256_loadu_ps(x.as_ptr().add(8))]
            }
        };
        // The maximum in 16 lanes by key index, then lane by lane: `x > m ? x : m` throughout.
        let mut mv = [ninf; 2];
        for t in t_lo..tiles {
            let x = load(t, f32::NEG_INFINITY);
            mv = [_mm256_max_ps(x[0], mv[0]), _mm256_max_ps(x[1], mv[1])];
        }
        let mut lanes = [0f32; LANES];
        _mm256_storeu_ps(lanes.as_mut_ptr(), mv[0]);
        _mm256_storeu_ps(lanes.as_mut_ptr().add(8), mv[1]);
        let m = lanes.iter().fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
        let mm = _mm256_set1_ps(m);
        let mut sv = [_mm256_setzero_ps(); 2];
        for t in t_lo..tiles {
            let x = load(t, 0.0);
            let valid = n - LANES * t;
            for h in 0..2 {
                let mut w = expf::expf8_avx2(_mm256_sub_ps(x[h], mm));
                if valid < 8 * (h + 1) {
                    // Zero past the query's keys.
                    let k = valid.saturating_sub(8 * h) as i32;
                    let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                    let keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(k), idx);
                    w = _mm256_and_ps(w, _mm256_castsi256_ps(keep));
                }
                _mm256_storeu_ps(row.add(LANES * t + 8 * h), w);
                sv[h] = _mm256_add_ps(sv[h], w);
            }
        }
        _mm256_storeu_ps(lanes.as_mut_ptr(), sv[0]);
        _mm256_storeu_ps(lanes.as_mut_ptr().add(8), sv[1]);
        st.sum[i] = super::reduce16(&lanes);
    }
    // 2. Values, two queries at a time over their common keys, then each query's own last keys;
    // 32 columns at a time.
    let mut i0 = 0;
    while i0 < nq {
        let n = 2.min(nq - i0);
        let common = len(i0);
        // The pair's first query has the earliest window; the other's weights are zero before
        // its own.
        let from = s.first_key(common - 1) / LANES * LANES;
        let w = |q: usize| e.as_ptr().add((i0 + q) * stride);
        for c0 in (0..d).step_by(8 * COLS) {
            let out = st.out.as_mut_ptr().add(i0 * d + c0);
            match n {
                2 => values::<2>(a, out, d, c0, [w(0), w(1)], from, common),
                _ => values::<1>(a, out, d, c0, [w(0)], from, common),
            }
            for q in 0..n {
                let end = len(i0 + q);
                if end > common {
                    values::<1>(a, out.add(q * d), d, c0, [w(q)], common, end);
                }
            }
        }
        i0 += n;
    }
}

/// Scaled scores of the task's queries, `[nq, stride]` (entries past a query's keys are
/// unspecified): 8 keys at a time through [`scores8`].
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
    let scale = _mm256_set1_ps(s.scale);
    let mut sc = vec![0f32; nq * stride];
    // The tile's keys widened to f32 once (exact), `[TILE, d]`; keys past the end stay zero.
    // Tiles before the first row's window are not scored.
    let mut kf = vec![0f32; TILE * d];
    for j0 in (s.first_key(s.start + r0) / TILE * TILE..lmax).step_by(TILE) {
        let nk = TILE.min(lmax - j0);
        let (keys, _, end) = kv.head_run(g, j0, j0 + nk);
        // A tile never spans two KV blocks (KV_BLOCK is a multiple of TILE).
        assert_eq!(end, j0 + nk, "attention: a key tile crosses a KV block");
        for t in 0..nk {
            let kp = keys[t * d..][..d].as_ptr();
            for c in 0..2 * NV {
                _mm256_storeu_ps(kf.as_mut_ptr().add(t * d + 8 * c), load8h(kp.add(8 * c)));
            }
        }
        if nk < TILE {
            kf[nk * d..].fill(0.0);
        }
        for i in 0..nq {
            if j0 >= len(i) {
                continue;
            }
            let r = scores8::<NV>(qs[i * d..][..d].as_ptr(), kf.as_ptr());
            _mm256_storeu_ps(sc.as_mut_ptr().add(i * stride + j0), _mm256_mul_ps(r, scale));
        }
    }
    sc
}

/// Unscaled `dot_f16(q, k_t)` for the 8 keys at `k` (`[TILE, 16 * NV]` f32), lane t.
#[inline(always)]
unsafe fn scores8<const NV: usize>(q: *const f32, k: *const f32) -> __m256 {
    // Per key: four 16-lane accumulators (two registers each) over steps of 64 elements,
    // (0 + 2) + (1 + 3), then the first halving step (8 + 8) of the 16 lanes.
    let mut tv = [_mm256_setzero_ps(); TILE];
    for (t, o) in tv.iter_mut().enumerate() {
        let kp = k.add(t * 16 * NV);
        let mut acc = [[_mm256_setzero_ps(); 2]; 4];
        for step in 0..NV / 4 {
            for (j, aj) in acc.iter_mut().enumerate() {
                let c = 4 * step + j;
                for (h, r) in aj.iter_mut().enumerate() {
                    let off = 16 * c + 8 * h;
                    *r = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(off)), _mm256_loadu_ps(kp.add(off)), *r);
                }
            }
        }
        let x = |h: usize| _mm256_add_ps(_mm256_add_ps(acc[0][h], acc[2][h]), _mm256_add_ps(acc[1][h], acc[3][h]));
        *o = _mm256_add_ps(x(1), x(0));
    }
    // 4 + 4 (128-bit lane L of u[p] holds u of key 2p + L), then (0 + 2) and (1 + 3), then
    // their sum: the rest of `reduce16` on 8 keys at once.
    let mut u = [_mm256_setzero_ps(); 4];
    for (p, o) in u.iter_mut().enumerate() {
        let (a, b) = (tv[2 * p], tv[2 * p + 1]);
        *o = _mm256_add_ps(
            _mm256_permute2f128_ps::<0x31>(a, b),
            _mm256_permute2f128_ps::<0x20>(a, b),
        );
    }
    // Lane L of v[s]: [u0 + u2, u1 + u3] of key 4s + L, then of key 4s + 2 + L.
    let mut v = [_mm256_setzero_ps(); 2];
    for (ss, o) in v.iter_mut().enumerate() {
        let (a, b) = (u[2 * ss], u[2 * ss + 1]);
        *o = _mm256_add_ps(
            _mm256_shuffle_ps::<0b01_00_01_00>(a, b),
            _mm256_shuffle_ps::<0b11_10_11_10>(a, b),
        );
    }
    // Element 4L + e holds key 2e + L.
    let r = _mm256_add_ps(
        _mm256_shuffle_ps::<0b10_00_10_00>(v[0], v[1]),
        _mm256_shuffle_ps::<0b11_01_11_01>(v[0], v[1]),
    );
    _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// Registers of 8 columns per query in [`values`]: two queries' accumulators then take 8 of
/// the 16 registers.
const COLS: usize = 4;

/// Keys `j0 .. j1` into the f32 accumulators of `QC` queries (query q's at `out + q * d`),
/// columns `c0 .. c0 + 8 * COLS` of the head, with weights `w`:
/// `acc = fma(v_j, w_j, acc)` in key order; the accumulators are read and written.
#[inline(never)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn values<const QC: usize>(
    a: &Args<'_>,
    out: *mut f32,
    d: usize,
    c0: usize,
    w: [*const f32; QC],
    j0: usize,
    j1: usize,
) {
    let mut acc = [[_mm256_setzero_ps(); COLS]; QC];
    for (q, regs) in acc.iter_mut().enumerate() {
        for (c, r) in regs.iter_mut().enumerate() {
            *r = _mm256_loadu_ps(out.add(q * d + 8 * c));
        }
    }
    let mut j = j0;
    while j < j1 {
        let (_, values, end) = a.kv.head_run(a.g, j, j1);
        for (jj, row) in (j..end).zip(values.chunks_exact(d)) {
            let vp = row.as_ptr().add(c0);
            let wv: [__m256; QC] = std::array::from_fn(|q| _mm256_set1_ps(*w[q].add(jj)));
            for c in 0..COLS {
                let x = load8h(vp.add(8 * c));
                for (q, regs) in acc.iter_mut().enumerate() {
                    regs[c] = _mm256_fmadd_ps(x, wv[q], regs[c]);
                }
            }
        }
        j = end;
    }
    for (q, regs) in acc.iter().enumerate() {
        for (c, r) in regs.iter().enumerate() {
            _mm256_storeu_ps(out.add(q * d + 8 * c), *r);
        }
    }
}
