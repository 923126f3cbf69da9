//! Causal grouped-query attention over an f16 KV cache, computed row by row.
//!
//! Each (query row, head) pair is reduced over exactly the keys at positions `0..=pos`, in a
//! fixed order of operations that does not depend on how many rows are computed together. A
//! verify row at position p therefore gets the bits a one-row decode step at p gets (the
//! batch-invariance Specula's exactness needs; see DESIGN.md).
//!
//! Serving uses [`AttnMode::TwoPass`]: f32 scores, the exact maximum, then the exponentials,
//! their sum in a fixed lane order and the values accumulated in f32, key by key. The other
//! two modes are llama.cpp's CPU `flash_attn_ext` arithmetic (its default on CPU), operation for
//! operation, for the reference comparison with llama.cpp (docs/perf.md, "Reference
//! agreement"): llama.cpp picks one by the number of rows in a micro-batch, [`AttnMode::OneChunk`]
//! (fewer than 64 rows: decode steps and short prompts) and [`AttnMode::Tiled`] (64 rows or
//! more). Its one-chunk form rounds the output accumulator to f16 after every key (an FMA and two
//! conversions per key and dimension); [`AttnMode::TwoPass`] measured 1.3x its decode speed at a
//! 1,800-token context and 1.3-1.6x its prefill (docs/perf.md). `SPECULA_ATTN=onechunk` /
//! `=tiled` select those for serving (comparisons only).
//!
//! Keys and values arrive already rounded to f16 (llama.cpp's default cache type), held as f32.
//! Softmax is the max-subtracted online form (Milakov & Gimelshein 2018; scaled dot-product
//! attention, Vaswani et al. 2017).

#[cfg(target_arch = "x86_64")]
mod avx2;
mod expf;
#[cfg(target_arch = "x86_64")]
mod fast;

pub use expf::expf;

use crate::kv_cache::KvRows;

/// Shape of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    /// Query rows `n`; row r sits at absolute position `start + r`.
    pub rows: usize,
    pub start: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Sliding-window attention: a row at position `p` sees the keys `p + 1 - window ..= p`
    /// (those that exist); None: `0 ..= p`.
    pub window: Option<usize>,
    /// The factor the scores `dot(q, k)` are multiplied by: `1/sqrt(head_dim)`, or 1 where the
    /// queries were scaled already.
    pub scale: f32,
}

impl AttnShape {
    /// The first key a row at absolute position `pos` sees.
    #[inline]
    pub fn first_key(&self, pos: usize) -> usize {
        match self.window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        }
    }
}

/// How the attention of a row is reduced: Specula's serving arithmetic, or one of the two CPU
/// paths of llama.cpp's `flash_attn_ext` with an f16 K/V cache (`ggml-cpu/ops.cpp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttnMode {
    /// Specula's serving arithmetic, for query row `q` (f32) over keys `0 .. L`:
    /// `s_j = dot_f16(q, k_j) * scale` (the tree of [`AttnMode::OneChunk`]'s scores, on the
    /// unrounded query); `M` = the maximum of the `s_j` (16 lanes by `j mod 16`, then lane by
    /// lane); `e_j = expf(s_j - M)` (glibc's `expf` bits); `S` = the `e_j` summed in 16 lanes by
    /// `j mod 16` in key order, then `reduce16`; `out = (sum over j in key order of fma(v_j,
    /// e_j, .)) * (1 / S)`, all f32 (scaled dot-product attention, Vaswani et al. 2017, with the
    /// max-subtracted softmax).
    TwoPass,
    /// `flash_attn_ext_f16_one_chunk`: q rounded to f16, scores by `ggml_vec_dot_f16`, online
    /// softmax key by key with `expf`, V accumulated in f16 (`ggml_vec_mad_f16`), one division
    /// by the sum at the end.
    OneChunk,
    /// `flash_attn_ext_tiled`: f32 q, each score one sequential FMA chain over the head
    /// dimension, softmax per tile of 64 keys (at absolute positions 0, 64, ...) with ggml's
    /// vector `expf`, tile sums in f64, V accumulated in f32 with FMAs.
    Tiled,
}

/// The attention mode of this thread: the one [`with_mode`] set, else the process's
/// (`SPECULA_ATTN=onechunk` / `=tiled`, or the default [`AttnMode::TwoPass`]).
pub fn mode() -> AttnMode {
    static M: std::sync::OnceLock<AttnMode> = std::sync::OnceLock::new();
    if let Some(m) = MODE_OVERRIDE.with(|c| c.get()) {
        return m;
    }
    *M.get_or_init(|| match std::env::var("SPECULA_ATTN").as_deref() {
        Ok("tiled") => AttnMode::Tiled,
        Ok("onechunk") => AttnMode::OneChunk,
        _ => AttnMode::TwoPass,
    })
}

thread_local! {
    static MODE_OVERRIDE: std::cell::Cell<Option<AttnMode>> = const { std::cell::Cell::new(None) };
}

/// Run `f` with every attention call of this thread in mode `m` (the forward pass attends on
/// its calling thread). For reproducing llama.cpp's own evaluation, which picks the mode by
/// the number of rows in a micro-batch ([`crate::engine::Engine::logits_as_llamacpp`]); serving
/// keeps one mode for every row count, as batch invariance requires.
pub fn with_mode<R>(m: AttnMode, f: impl FnOnce() -> R) -> R {
    crate::kernels::with_thread_local(&MODE_OVERRIDE, Some(m), f)
}

/// Round to the nearest f16 value (ties to even), returned as f32: ggml's
/// `GGML_CPU_FP32_TO_FP16` followed by `GGML_CPU_FP16_TO_FP32`.
#[inline]
pub fn round_f16(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// ggml's vectorised `ggml_v_expf` (the AVX-512 variant; an Arm-optimized-routines polynomial,
/// max error ~1.5 ulp), lane by lane. Used by ggml's softmax and SiLU.
#[inline]
pub fn v_expf(x: f32) -> f32 {
    let r = f32::from_bits(0x4b40_0000); // 0x1.8p23
    let z = x.mul_add(f32::from_bits(0x3fb8_aa3b), r); // log2(e)
    let n = z - r;
    let b = (-n).mul_add(
        f32::from_bits(0x35bf_be8e),
        (-n).mul_add(f32::from_bits(0x3f31_7200), x),
    );
    let u = b * b;
    let a = f32::from_bits(0x3c07_2010)
        .mul_add(b, f32::from_bits(0x3d2b_9f17))
        .mul_add(u, f32::from_bits(0x3e2a_af33).mul_add(b, f32::from_bits(0x3eff_fedb)));
    let j = a.mul_add(u, f32::from_bits(0x3f7f_fff6).mul_add(b, 1.0));
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    // `_mm512_scalef_ps(j, n)`: j * 2^n, rounded once (the f64 product is exact).
    (j as f64 * 2f64.powi(n as i32)) as f32
}

/// ggml's `swiglu` (`ggml_vec_swiglu_f32`): `out[i] = silu(g[i]) * u[i]`, `silu(x) =
/// x / (1 + e^-x)` with e^x from [`v_expf`]. Element-wise, so batch-invariant.
pub fn silu_mul(g: &[f32], u: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; g.len()];
    simd::silu_mul(fast(), g, u, &mut out);
    out
}

/// GELU with the tanh approximation (Hendrycks & Gimpel 2016), as ggml computes it in f32:
/// `0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2)))` (`ggml_gelu_f32`, libm's `tanhf`).
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const COEF_A: f32 = 0.044715;
    // GCC contracts `1 + a*x*x` into one FMA (ggml is built with -march=native, GNU C).
    let inner = (COEF_A * x).mul_add(x, 1.0f32);
    0.5f32 * x * (1.0f32 + (SQRT_2_OVER_PI * x * inner).tanh())
}

/// ggml's table of [`gelu_tanh`] over every f16 input (`ggml_table_gelu_f16`, built at
/// `ggml_cpu_init`), the results rounded to f16, held as f32: index by the input's f16 bits.
fn gelu_table() -> &'static [f32] {
    static T: std::sync::OnceLock<Vec<f32>> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        (0..=u16::MAX)
            .map(|b| half::f16::from_f32(gelu_tanh(half::f16::from_bits(b).to_f32())).to_f32())
            .collect()
    })
}

/// `gelu(g) * u` element-wise (GeGLU; Shazeer 2020) as ggml's CPU `geglu` computes it in f32
/// (`ggml_vec_geglu_f32` with `GGML_GELU_FP16`): 0 for `g <= -10`, `g * u` for `g >= 10`,
/// else the [`gelu_table`] entry of `g` rounded to f16, times `u`. Element-wise, so
/// batch-invariant. `g`, `u`: the same length; returns that many values.
pub fn gelu_mul(g: &[f32], u: &[f32]) -> Vec<f32> {
    let t = gelu_table();
    g.iter()
        .zip(u)
        .map(|(&x, &v)| {
            if x <= -10.0 {
                0.0
            } else if x >= 10.0 {
                x * v
            } else {
                t[half::f16::from_f32(x).to_bits() as usize] * v
            }
        })
        .collect()
}

/// `_mm512_reduce_add_ps` on 16 lanes: GCC's halving tree (8 + 8, 4 + 4, then the pairs).
#[inline(always)]
fn reduce16(a: &[f32; 16]) -> f32 {
    let mut t = [0f32; 8];
    for i in 0..8 {
        t[i] = a[i + 8] + a[i];
    }
    let mut u = [0f32; 4];
    for i in 0..4 {
        u[i] = t[i + 4] + t[i];
    }
    (u[0] + u[2]) + (u[1] + u[3])
}

/// ggml's `ggml_vec_dot_f16` as built for x86 with AVX-512: four 16-lane FMA accumulators over
/// steps of 64 elements, combined as (0 + 2) + (1 + 3), reduced by [`reduce16`], leftovers
/// added in f64.
#[inline(always)]
fn dot_f16(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    let np = n & !63;
    let mut acc = [[0f32; 16]; 4];
    for i in (0..np).step_by(64) {
        for (j, lanes) in acc.iter_mut().enumerate() {
            for (l, s) in lanes.iter_mut().enumerate() {
                let k = i + 16 * j + l;
                *s = a[k].mul_add(b[k], *s);
            }
        }
    }
    let mut x = [0f32; 16];
    for l in 0..16 {
        x[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
    let mut sum = reduce16(&x) as f64;
    for k in np..n {
        sum += (a[k] * b[k]) as f64;
    }
    sum as f32
}

/// Multiply-adds (rows × keys × heads × head_dim) below which one attention call runs on the
/// calling thread: a fork-join costs about a microsecond.
const ATTN_PARALLEL_MIN: usize = 1 << 13;

/// Keys per softmax tile of [`AttnMode::Tiled`] (`GGML_FA_TILE_KV`).
const KV_TILE: usize = 64;

/// Query rows per attention task: bounds the state of a task during long prefills.
const ROW_BLOCK: usize = 16;

/// The per-(row, head) state of an online softmax.
struct State {
    /// Running maximum score, per (row, head) of the task.
    m: Vec<f32>,
    /// Running sum of exponentials.
    sum: Vec<f32>,
    /// Unnormalised output, `[rows * group, head_dim]`.
    out: Vec<f32>,
}

/// Element-wise kernels of the V updates and scores, scalar or AVX2 (bitwise equal).
mod simd {
    use super::round_f16;

    /// `acc[i] = f16(fma(v[i], w, acc[i]))` (`ggml_vec_mad_f16`).
    #[inline(always)]
    pub fn mad_f16(fast: bool, acc: &mut [f32], v: &[f32], w: f32) {
        #[cfg(target_arch = "x86_64")]
        if fast && acc.len().is_multiple_of(8) {
            // SAFETY: `fast` means AVX2, FMA and F16C were detected at run time.
            return unsafe { x86::mad_f16(acc, v, w) };
        }
        let _ = fast;
        for (a, &x) in acc.iter_mut().zip(v) {
            *a = round_f16(x.mul_add(w, *a));
        }
    }

    /// `acc[i] = f16(acc[i] * w)` (`ggml_vec_scale_f16`).
    #[inline(always)]
    pub fn scale_f16(fast: bool, acc: &mut [f32], w: f32) {
        #[cfg(target_arch = "x86_64")]
        if fast && acc.len().is_multiple_of(8) {
            // SAFETY: `fast` means AVX2, FMA and F16C were detected at run time.
            return unsafe { x86::scale_f16(acc, w) };
        }
        let _ = fast;
        for a in acc.iter_mut() {
            *a = round_f16(*a * w);
        }
    }

    /// `out[i] = silu(g[i]) * u[i]` with `silu(x) = x / (1 + v_expf(0 - x))` (`ggml_vec_swiglu_f32`).
    #[inline(always)]
    pub fn silu_mul(fast: bool, g: &[f32], u: &[f32], out: &mut [f32]) {
        let mut done = 0;
        #[cfg(target_arch = "x86_64")]
        if fast {
            done = g.len() & !7;
            // SAFETY: as above.
            unsafe { x86::silu_mul(&g[..done], &u[..done], &mut out[..done]) };
        }
        let _ = fast;
        for ((o, &x), &y) in out[done..].iter_mut().zip(&g[done..]).zip(&u[done..]) {
            *o = x / (1.0 + super::v_expf(0.0 - x)) * y;
        }
    }

    /// `acc[i] = fma(v[i], w, acc[i])` (the V product of `simd_gemm`).
    #[inline(always)]
    pub fn mad_f32(fast: bool, acc: &mut [f32], v: &[f32], w: f32) {
        #[cfg(target_arch = "x86_64")]
        if fast && acc.len().is_multiple_of(8) {
            // SAFETY: as above.
            return unsafe { x86::mad_f32(acc, v, w) };
        }
        let _ = fast;
        for (a, &x) in acc.iter_mut().zip(v) {
            *a = x.mul_add(w, *a);
        }
    }

    /// [`super::dot_f16`].
    #[inline(always)]
    pub fn dot_f16(fast: bool, a: &[f32], b: &[f32]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if fast && a.len().is_multiple_of(64) {
            // SAFETY: as above.
            return unsafe { x86::dot_f16(a, b) };
        }
        let _ = fast;
        super::dot_f16(a, b)
    }

    /// Scores of one query against the keys of a transposed tile `kt` (`[head_dim, KV_TILE]`):
    /// `out[tk] = fma-chain over d of kt[d][tk] * q[d]`, in order of d (`simd_gemm`).
    #[inline(always)]
    pub fn tile_scores(fast: bool, out: &mut [f32; super::KV_TILE], kt: &[f32], q: &[f32]) {
        #[cfg(target_arch = "x86_64")]
        if fast {
            // SAFETY: as above.
            return unsafe { x86::tile_scores(out, kt, q) };
        }
        let _ = fast;
        out.fill(0.0);
        for (d, &qd) in q.iter().enumerate() {
            let row = &kt[d * super::KV_TILE..][..super::KV_TILE];
            for (o, &k) in out.iter_mut().zip(row) {
                *o = k.mul_add(qd, *o);
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    mod x86 {
        use std::arch::x86_64::*;

        #[target_feature(enable = "avx2,fma,f16c")]
        pub unsafe fn mad_f16(acc: &mut [f32], v: &[f32], w: f32) {
            let wv = _mm256_set1_ps(w);
            for (a, x) in acc.chunks_exact_mut(8).zip(v.chunks_exact(8)) {
                let y = _mm256_fmadd_ps(_mm256_loadu_ps(x.as_ptr()), wv, _mm256_loadu_ps(a.as_ptr()));
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(y);
                _mm256_storeu_ps(a.as_mut_ptr(), _mm256_cvtph_ps(h));
            }
        }

        #[target_feature(enable = "avx2,fma,f16c")]
        pub unsafe fn scale_f16(acc: &mut [f32], w: f32) {
            let wv = _mm256_set1_ps(w);
            for a in acc.chunks_exact_mut(8) {
                let y = _mm256_mul_ps(_mm256_loadu_ps(a.as_ptr()), wv);
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(y);
                _mm256_storeu_ps(a.as_mut_ptr(), _mm256_cvtph_ps(h));
            }
        }

        /// [`super::super::v_expf`] on 8 lanes.
        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn v_expf8(x: __m256) -> __m256 {
            let r = _mm256_set1_ps(f32::from_bits(0x4b40_0000));
            let z = _mm256_fmadd_ps(x, _mm256_set1_ps(f32::from_bits(0x3fb8_aa3b)), r);
            let n = _mm256_sub_ps(z, r);
            let b = _mm256_fnmadd_ps(
                n,
                _mm256_set1_ps(f32::from_bits(0x35bf_be8e)),
                _mm256_fnmadd_ps(n, _mm256_set1_ps(f32::from_bits(0x3f31_7200)), x),
            );
            let u = _mm256_mul_ps(b, b);
            let c = |bits: u32| _mm256_set1_ps(f32::from_bits(bits));
            let a = _mm256_fmadd_ps(
                _mm256_fmadd_ps(c(0x3c07_2010), b, c(0x3d2b_9f17)),
                u,
                _mm256_fmadd_ps(c(0x3e2a_af33), b, c(0x3eff_fedb)),
            );
            let j = _mm256_fmadd_ps(a, u, _mm256_fmadd_ps(c(0x3f7f_fff6), b, _mm256_set1_ps(1.0)));
            // j * 2^n with 2^n built from its exponent bits: one rounding, like `scalef`, while
            // 2^n is a normal f32 (|n| <= 126); other lanes (|x| > ~87) take the scalar path.
            let pow = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
                _mm256_cvtps_epi32(n),
                _mm256_set1_epi32(127),
            )));
            let res = _mm256_mul_ps(j, pow);
            let big = _mm256_cmp_ps::<_CMP_GT_OQ>(_mm256_andnot_ps(_mm256_set1_ps(-0.0), n), _mm256_set1_ps(126.0));
            if _mm256_movemask_ps(big) == 0 {
                return res;
            }
            let mut xs = [0f32; 8];
            let mut rs = [0f32; 8];
            _mm256_storeu_ps(xs.as_mut_ptr(), x);
            _mm256_storeu_ps(rs.as_mut_ptr(), res);
            let mask = _mm256_movemask_ps(big);
            for l in 0..8 {
                if mask & (1 << l) != 0 {
                    rs[l] = super::super::v_expf(xs[l]);
                }
            }
            _mm256_loadu_ps(rs.as_ptr())
        }

        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn silu_mul(g: &[f32], u: &[f32], out: &mut [f32]) {
            let one = _mm256_set1_ps(1.0);
            for ((x, y), o) in g.chunks_exact(8).zip(u.chunks_exact(8)).zip(out.chunks_exact_mut(8)) {
                let xv = _mm256_loadu_ps(x.as_ptr());
                let e = v_expf8(_mm256_sub_ps(_mm256_setzero_ps(), xv));
                let s = _mm256_div_ps(xv, _mm256_add_ps(one, e));
                _mm256_storeu_ps(o.as_mut_ptr(), _mm256_mul_ps(s, _mm256_loadu_ps(y.as_ptr())));
            }
        }

        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn mad_f32(acc: &mut [f32], v: &[f32], w: f32) {
            let wv = _mm256_set1_ps(w);
            for (a, x) in acc.chunks_exact_mut(8).zip(v.chunks_exact(8)) {
                let y = _mm256_fmadd_ps(_mm256_loadu_ps(x.as_ptr()), wv, _mm256_loadu_ps(a.as_ptr()));
                _mm256_storeu_ps(a.as_mut_ptr(), y);
            }
        }

        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn dot_f16(a: &[f32], b: &[f32]) -> f32 {
            // acc[j][h]: lanes 8h..8h+8 of the 16-lane accumulator j.
            let mut acc = [[_mm256_setzero_ps(); 2]; 4];
            for (ca, cb) in a.chunks_exact(64).zip(b.chunks_exact(64)) {
                for (j, pair) in acc.iter_mut().enumerate() {
                    for (h, s) in pair.iter_mut().enumerate() {
                        let o = 16 * j + 8 * h;
                        *s = _mm256_fmadd_ps(
                            _mm256_loadu_ps(ca.as_ptr().add(o)),
                            _mm256_loadu_ps(cb.as_ptr().add(o)),
                            *s,
                        );
                    }
                }
            }
            let lo = _mm256_add_ps(_mm256_add_ps(acc[0][0], acc[2][0]), _mm256_add_ps(acc[1][0], acc[3][0]));
            let hi = _mm256_add_ps(_mm256_add_ps(acc[0][1], acc[2][1]), _mm256_add_ps(acc[1][1], acc[3][1]));
            // reduce16: t = hi + lo (8 lanes), u = t[4..8] + t[0..4], (u0 + u2) + (u1 + u3).
            let t = _mm256_add_ps(hi, lo);
            let u = _mm_add_ps(_mm256_extractf128_ps::<1>(t), _mm256_castps256_ps128(t));
            let w = _mm_add_ps(u, _mm_movehl_ps(u, u));
            let r = _mm_add_ss(w, _mm_movehdup_ps(w));
            _mm_cvtss_f32(r)
        }

        #[target_feature(enable = "avx2,fma")]
        pub unsafe fn tile_scores(out: &mut [f32; super::super::KV_TILE], kt: &[f32], q: &[f32]) {
            const T: usize = super::super::KV_TILE;
            let mut acc = [_mm256_setzero_ps(); T / 8];
            for (d, &qd) in q.iter().enumerate() {
                let qv = _mm256_set1_ps(qd);
                let row = kt.as_ptr().add(d * T);
                for (c, s) in acc.iter_mut().enumerate() {
                    *s = _mm256_fmadd_ps(_mm256_loadu_ps(row.add(8 * c)), qv, *s);
                }
            }
            for (c, s) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.as_mut_ptr().add(8 * c), *s);
            }
        }
    }
}

/// Are AVX2, FMA and F16C available (the fast paths of [`simd`])?
fn fast() -> bool {
    static F: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *F.get_or_init(crate::kernels::qmatmul::has_avx2)
}

/// `q`: `[rows, num_heads, head_dim]` f32; `kv`: the layer's cache ([`KvRows`], f16, with
/// `num_kv_heads` heads of `head_dim`) holding at least `start + rows` positions. Returns
/// `[rows, num_heads, head_dim]` f32. Panics when the cache's head layout is not the shape's.
///
/// Work is split into tasks of (KV head, block of up to [`ROW_BLOCK`] rows). A task walks the
/// keys and values of its KV head once and uses each for every query head of the group and
/// every row of the block (grouped-query attention reads K/V once per group, and a verify block
/// reads them once for all its rows). The arithmetic of each (row, head) is unchanged by this
/// sharing: the same scores, the same ascending-position online softmax and accumulation.
pub fn attend(q: &[f32], kv: &KvRows<'_>, s: &AttnShape) -> Vec<f32> {
    attend_mode(q, kv, s, mode())
}

/// [`attend`] with an explicit mode.
pub fn attend_mode(q: &[f32], kv: &KvRows<'_>, s: &AttnShape, mode: AttnMode) -> Vec<f32> {
    attend_with(&[AttnItem { q, kv, shape: *s }], mode, Path::Best)
}

/// One sequence's part of a batched attention call ([`attend_batch`]).
pub struct AttnItem<'a> {
    /// `[shape.rows, num_heads, head_dim]`.
    pub q: &'a [f32],
    pub kv: &'a KvRows<'a>,
    pub shape: AttnShape,
}

/// [`attend`] for several sequences (each its own rows, positions and cache) in one parallel
/// pass: the tasks of every sequence share the threads, so a batch of one-row decode steps
/// costs one fork-join instead of one per sequence. Returns the outputs of the items one after
/// the other (`[sum of rows, num_heads, head_dim]`), each exactly what [`attend`] gives it.
pub fn attend_batch(items: &[AttnItem<'_>]) -> Vec<f32> {
    attend_with(items, mode(), Path::Best)
}

/// Which implementation [`attend_with`] runs where a mode has several (all give the same bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    /// The definitions: [`one_chunk`] and [`two_pass`] (compiled with AVX2 where available).
    Reference,
    /// [`AttnMode::TwoPass`] through the AVX2 kernels ([`avx2`]) even where AVX-512 is there
    /// (for the tests, which compare every path this CPU has).
    #[cfg_attr(not(test), allow(dead_code))]
    Avx2,
    /// AVX-512 ([`fast`]) where available, else AVX2 for [`AttnMode::TwoPass`].
    Best,
}

/// [`attend_batch`] with an explicit mode and [`Path`].
fn attend_with(items: &[AttnItem<'_>], mode: AttnMode, path: Path) -> Vec<f32> {
    let Some(first) = items.first() else {
        return Vec::new();
    };
    let (num_heads, num_kv_heads, d) = (first.shape.num_heads, first.shape.num_kv_heads, first.shape.head_dim);
    for it in items {
        let s = &it.shape;
        assert!(
            (s.num_heads, s.num_kv_heads, s.head_dim) == (num_heads, num_kv_heads, d),
            "attention: items of one batch share the head layout"
        );
        // The AVX-512 passes read `head_dim` values per cached row through raw pointers.
        assert!(
            (it.kv.kv_heads(), it.kv.head_dim()) == (num_kv_heads, d),
            "attention: a cache of {} heads x {} for a shape of {num_kv_heads} x {d}",
            it.kv.kv_heads(),
            it.kv.head_dim()
        );
        assert!(
            it.kv.positions() >= s.start + s.rows,
            "attention: {} cached positions, {} needed",
            it.kv.positions(),
            s.start + s.rows
        );
    }
    let group = num_heads / num_kv_heads;
    // Tasks: (item, row block, KV head), with the query heads of each group split over several
    // tasks when that evens out the threads' shares: the split with the fewest heads on the
    // busiest thread, the smallest such (fewer heads per task means less overlap of their
    // dependency chains). Three KV heads on two threads: three heads per task leave one thread
    // six heads to the other's three, one head per task five to four. Each (row, head) is
    // computed alike whatever the split.
    let blocks: usize = items.iter().map(|it| it.shape.rows.div_ceil(ROW_BLOCK)).sum();
    let threads = crate::kernels::pool::threads();
    let splits = (1..=group)
        .filter(|sp| group % sp == 0)
        .min_by_key(|&sp| (blocks * num_kv_heads * sp).div_ceil(threads) * (group / sp))
        .unwrap_or(group);
    let nh = group / splits;
    // (item, first row, first query head, KV head) per task, and where its output goes.
    let mut tasks = Vec::with_capacity(blocks * num_kv_heads * splits);
    let mut row_base = 0;
    for (ii, it) in items.iter().enumerate() {
        for r0 in (0..it.shape.rows).step_by(ROW_BLOCK) {
            for sp in 0..splits {
                for g in 0..num_kv_heads {
                    tasks.push((ii, r0, g * group + sp * nh, g, row_base));
                }
            }
        }
        row_base += it.shape.rows;
    }
    let fast = fast();
    #[cfg(target_arch = "x86_64")]
    let avx512 = path == Path::Best && matches!(mode, AttnMode::OneChunk | AttnMode::TwoPass) && fast::usable(d);
    #[cfg(target_arch = "x86_64")]
    let avx2 = path != Path::Reference && mode == AttnMode::TwoPass && !avx512 && avx2::usable(d);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = path;
    let task = |&(ii, r0, h0, g, _): &(usize, usize, usize, usize, usize)| -> Vec<f32> {
        let (q, s) = (items[ii].q, &items[ii].shape);
        let nr = ROW_BLOCK.min(s.rows - r0);
        let nq = nr * nh;
        // The block's query vectors in (row, head) order; f16-rounded for OneChunk.
        let mut qs = vec![0f32; nq * d];
        for r in 0..nr {
            let src = &q[((r0 + r) * num_heads + h0) * d..][..nh * d];
            let dst = &mut qs[r * nh * d..][..nh * d];
            for (o, &x) in dst.iter_mut().zip(src) {
                *o = if mode == AttnMode::OneChunk { round_f16(x) } else { x };
            }
        }
        let mut st = State {
            m: vec![f32::NEG_INFINITY; nq],
            sum: vec![0f32; nq],
            out: vec![0f32; nq * d],
        };
        let a = Args {
            qs: &qs,
            kv: items[ii].kv,
            s,
            g,
            r0,
            nr,
            nh,
        };
        match (mode, fast) {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `fast::usable` checked AVX-512F, FMA and F16C at run time.
            (AttnMode::TwoPass, _) if avx512 => unsafe { fast::two_pass(&a, &mut st) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `avx2::usable` checked AVX2, FMA and F16C at run time.
            (AttnMode::TwoPass, _) if avx2 => unsafe { avx2::two_pass(&a, &mut st) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `fast` means AVX2, FMA and F16C were detected at run time.
            (AttnMode::TwoPass, true) => unsafe { two_pass_x86(&a, &mut st) },
            (AttnMode::TwoPass, _) => two_pass::<false>(&a, &mut st),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `fast::usable` checked AVX-512F, FMA and F16C at run time.
            (AttnMode::OneChunk, _) if avx512 => unsafe { fast::one_chunk(&a, &mut st) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `fast` means AVX2, FMA and F16C were detected at run time.
            (AttnMode::OneChunk, true) => unsafe { one_chunk_x86(&a, &mut st) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above.
            (AttnMode::Tiled, true) => unsafe { tiled_x86(&a, &mut st) },
            (AttnMode::OneChunk, _) => one_chunk::<false>(&a, &mut st),
            (AttnMode::Tiled, _) => tiled::<false>(&a, &mut st),
        }
        // V /= S (`ggml_vec_scale_f32` by 1/S).
        for i in 0..nq {
            let inv = if st.sum[i] == 0.0 { 0.0 } else { 1.0 / st.sum[i] };
            for a in st.out[i * d..(i + 1) * d].iter_mut() {
                *a *= inv;
            }
        }
        st.out
    };
    let work: usize = items
        .iter()
        .map(|it| it.shape.rows * (it.shape.start + it.shape.rows))
        .sum::<usize>()
        * num_heads
        * d;
    let parts: Vec<Vec<f32>> = if work < ATTN_PARALLEL_MIN {
        tasks.iter().map(task).collect()
    } else {
        let slots: Vec<std::sync::Mutex<Vec<f32>>> = tasks.iter().map(|_| Default::default()).collect();
        crate::kernels::pool::for_each(tasks.len(), &|i| {
            let part = task(&tasks[i]);
            *slots[i].lock().unwrap_or_else(|e| e.into_inner()) = part;
        });
        slots
            .into_iter()
            .map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner()))
            .collect()
    };
    let mut out = vec![0f32; row_base * num_heads * d];
    for (&(_, r0, h0, _, base), part) in tasks.iter().zip(&parts) {
        for (ri, rows) in part.chunks(nh * d).enumerate() {
            let dst = ((base + r0 + ri) * num_heads + h0) * d;
            out[dst..dst + nh * d].copy_from_slice(rows);
        }
    }
    out
}

/// The inputs of one attention task: the block's queries `qs` (`[nr * nh, head_dim]`: `nh`
/// query heads of KV head `g`'s group per row), the cache, and the rows `r0 .. r0 + nr`.
#[derive(Clone, Copy)]
struct Args<'a> {
    qs: &'a [f32],
    kv: &'a KvRows<'a>,
    s: &'a AttnShape,
    g: usize,
    r0: usize,
    nr: usize,
    nh: usize,
}

/// [`one_chunk`] compiled with AVX2, FMA and F16C (scalar `mul_add` becomes one instruction).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn one_chunk_x86(a: &Args<'_>, st: &mut State) {
    one_chunk::<true>(a, st)
}

/// [`two_pass`] compiled with AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn two_pass_x86(a: &Args<'_>, st: &mut State) {
    two_pass::<true>(a, st)
}

/// [`AttnMode::TwoPass`] for the rows `r0 .. r0 + nr` of KV head `g`, the definition (the
/// AVX-512 path, `fast::two_pass`, gives these bits): per (row, head) the scores of its keys,
/// their maximum and sum in lanes of 16 by key index, then the weighted values in key order.
/// Leaves the unnormalised output in `st.out` and the sum in `st.sum`.
#[inline(always)]
fn two_pass<const FAST: bool>(a: &Args<'_>, st: &mut State) {
    let Args {
        qs,
        kv,
        s,
        g,
        r0,
        nr,
        nh: group,
    } = *a;
    let d = s.head_dim;
    let scale = s.scale;
    let mut e = Vec::new();
    let (mut kb, mut vb) = (vec![0f32; d], vec![0f32; d]);
    for r in 0..nr {
        let n = s.start + r0 + r + 1;
        // Lanes are by absolute key index, so a window's first key sits in lane `lo % 16`.
        let lo = s.first_key(n - 1);
        for hh in 0..group {
            let i = r * group + hh;
            let q = &qs[i * d..][..d];
            e.clear();
            for j in lo..n {
                widen(kv.key(j, g), &mut kb);
                e.push(simd::dot_f16(FAST, q, &kb) * scale);
            }
            let mut lanes = [f32::NEG_INFINITY; 16];
            for (j, &x) in (lo..).zip(e.iter()) {
                let m = &mut lanes[j % 16];
                *m = if x > *m { x } else { *m };
            }
            let m = lanes.iter().fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
            let mut sums = [0f32; 16];
            for (j, x) in (lo..).zip(e.iter_mut()) {
                *x = expf(*x - m);
                sums[j % 16] += *x;
            }
            st.sum[i] = reduce16(&sums);
            let acc = &mut st.out[i * d..(i + 1) * d];
            for (j, &w) in (lo..).zip(e.iter()) {
                widen(kv.value(j, g), &mut vb);
                simd::mad_f32(FAST, acc, &vb, w);
            }
        }
    }
}

/// A cached f16 row into `out` as f32 (exact).
#[inline(always)]
fn widen(src: &[half::f16], out: &mut [f32]) {
    use half::slice::HalfFloatSliceExt;
    src.convert_to_f32_slice(out);
}

/// [`tiled`] compiled with AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tiled_x86(a: &Args<'_>, st: &mut State) {
    tiled::<true>(a, st)
}

/// [`AttnMode::OneChunk`] for the rows `r0 .. r0 + nr` of KV head `g`: for each key in order,
/// `s = dot_f16(q, k) * scale`; on a new maximum the f16 accumulator is rescaled by
/// `expf(M_old - M)`, else the key's weight is `expf(s - M)`; `acc = f16(v * w + acc)`;
/// `S = S * ms + w` (one FMA, as GCC contracts it).
#[inline(always)]
fn one_chunk<const FAST: bool>(a: &Args<'_>, st: &mut State) {
    let Args {
        qs,
        kv,
        s,
        g,
        r0,
        nr,
        nh: group,
    } = *a;
    let fast = FAST;
    let d = s.head_dim;
    let scale = s.scale;
    let len = s.start + r0 + nr; // keys visible to the block's last row
    let (mut kb, mut vb) = (vec![0f32; d], vec![0f32; d]);
    // Keys outside a row's window are skipped, as llama.cpp skips keys its mask sets to -inf.
    for j in s.first_key(s.start + r0)..len {
        widen(kv.key(j, g), &mut kb);
        widen(kv.value(j, g), &mut vb);
        let (kj, vj) = (&kb[..], &vb[..]);
        for r in 0..nr {
            let pos = s.start + r0 + r;
            if j > pos || j < s.first_key(pos) {
                continue;
            }
            for hh in 0..group {
                let i = r * group + hh;
                let sc = simd::dot_f16(fast, &qs[i * d..][..d], kj) * scale;
                let acc = &mut st.out[i * d..(i + 1) * d];
                let (ms, vs);
                if sc > st.m[i] {
                    let mold = st.m[i];
                    st.m[i] = sc;
                    ms = expf(mold - sc);
                    vs = 1.0f32;
                    simd::scale_f16(fast, acc, ms);
                } else {
                    ms = 1.0f32;
                    vs = expf(sc - st.m[i]);
                }
                simd::mad_f16(fast, acc, vj, vs);
                st.sum[i] = st.sum[i].mul_add(ms, vs);
            }
        }
    }
}

/// [`AttnMode::Tiled`] for the rows `r0 .. r0 + nr` of KV head `g`: keys in tiles of
/// [`KV_TILE`] at absolute positions; per tile and (row, head): scores (FMA chains) times
/// scale, the tile maximum, a rescale by `expf(M_old - M_new)` when it grows, weights
/// `v_expf(s - M)` summed per 16 lanes and in f64, then `acc = fma(v, w, acc)` key by key.
#[inline(always)]
fn tiled<const FAST: bool>(a: &Args<'_>, st: &mut State) {
    let Args {
        qs,
        kv,
        s,
        g,
        r0,
        nr,
        nh: group,
    } = *a;
    let fast = FAST;
    let d = s.head_dim;
    let scale = s.scale;
    let len = s.start + r0 + nr;
    let mut kt = vec![0f32; d * KV_TILE]; // the tile's keys, transposed: [d][KV_TILE]
    let mut vb = vec![0f32; d];
    let mut kq = [0f32; KV_TILE];
    // Tiles wholly before every row's window are skipped; in the others, keys before a row's
    // window score -inf, as llama.cpp's mask sets them.
    let first_tile = s.first_key(s.start + r0) / KV_TILE * KV_TILE;
    for t0 in (first_tile..len).step_by(KV_TILE) {
        let t1 = (t0 + KV_TILE).min(len);
        kt.fill(0.0);
        for tk in 0..t1 - t0 {
            let kj = kv.key(t0 + tk, g);
            for (dd, &x) in kj.iter().enumerate() {
                kt[dd * KV_TILE + tk] = x.to_f32();
            }
        }
        for r in 0..nr {
            let pos = s.start + r0 + r;
            let lo = s.first_key(pos);
            if t0 > pos || t1 <= lo {
                continue;
            }
            let visible = (pos + 1).min(t1) - t0;
            let hidden_before = lo.saturating_sub(t0);
            for hh in 0..group {
                let i = r * group + hh;
                simd::tile_scores(fast, &mut kq, &kt, &qs[i * d..][..d]);
                let mut tile_max = f32::NEG_INFINITY;
                for (tk, x) in kq.iter_mut().enumerate() {
                    if tk < visible && tk >= hidden_before {
                        *x *= scale;
                        tile_max = tile_max.max(*x);
                    } else {
                        *x = f32::NEG_INFINITY;
                    }
                }
                let mnew = st.m[i].max(tile_max);
                let acc = &mut st.out[i * d..(i + 1) * d];
                if mnew > st.m[i] {
                    let ms = expf(st.m[i] - mnew);
                    for a in acc.iter_mut() {
                        *a *= ms;
                    }
                    st.sum[i] *= ms;
                }
                st.m[i] = mnew;
                let mut tsum = 0f64;
                for c in kq.chunks_exact_mut(16) {
                    let mut lanes = [0f32; 16];
                    for (l, x) in c.iter_mut().enumerate() {
                        *x = v_expf(*x - mnew);
                        lanes[l] = *x;
                    }
                    tsum += reduce16(&lanes) as f64;
                }
                st.sum[i] = (st.sum[i] as f64 + tsum) as f32;
                for (tk, &p) in kq[..visible].iter().enumerate() {
                    widen(kv.value(t0 + tk, g), &mut vb);
                    simd::mad_f32(fast, acc, &vb, p);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::KvBlocks;

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

    fn f16s(v: Vec<f32>) -> Vec<half::f16> {
        v.into_iter().map(half::f16::from_f32).collect()
    }

    /// f32 values rounded to f16.
    fn r16s(v: Vec<f32>) -> Vec<f32> {
        v.into_iter().map(round_f16).collect()
    }

    #[test]
    fn rows_match_single_row_bitwise() {
        let (h, kvh, pos) = (6, 2, 150);
        for d in [16, 64] {
            let keys = f16s(pseudo(pos * kvh * d, 1));
            let values = f16s(pseudo(pos * kvh * d, 2));
            // 9 rows: one task per KV head; 37 rows: several row blocks per KV head; 100 rows:
            // rows spanning several key tiles.
            for (rows, window) in [
                (9, None),
                (37, None),
                (100, None),
                (9, Some(7)),
                (37, Some(64)),
                (100, Some(90)),
            ] {
                let start = pos - rows;
                let q = pseudo(rows * h * d, 3);
                for mode in [AttnMode::TwoPass, AttnMode::OneChunk, AttnMode::Tiled] {
                    let shape = |rows, start| AttnShape {
                        rows,
                        start,
                        num_heads: h,
                        num_kv_heads: kvh,
                        head_dim: d,
                        window,
                        scale: 1.0 / (d as f32).sqrt(),
                    };
                    let blocks = KvBlocks::from_rows(&keys, &values, kvh, d);
                    let kv = blocks.rows();
                    let many = attend_mode(&q, &kv, &shape(rows, start), mode);
                    for r in 0..rows {
                        let one = attend_mode(&q[r * h * d..(r + 1) * h * d], &kv, &shape(1, start + r), mode);
                        assert_eq!(
                            many[r * h * d..(r + 1) * h * d]
                                .iter()
                                .map(|x| x.to_bits())
                                .collect::<Vec<_>>(),
                            one.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                            "{mode:?} d{d} row {r} window {window:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn simd_paths_match_portable_bitwise() {
        if !fast() {
            return;
        }
        let d = 128;
        let a = r16s(pseudo(d, 7));
        let b = r16s(pseudo(d, 8));
        assert_eq!(
            simd::dot_f16(true, &a, &b).to_bits(),
            simd::dot_f16(false, &a, &b).to_bits()
        );
        for w in [0.3f32, 1.0, 1e-3] {
            let mut x = r16s(pseudo(d, 9));
            let mut y = x.clone();
            simd::mad_f16(true, &mut x, &a, w);
            simd::mad_f16(false, &mut y, &a, w);
            assert_eq!(x, y);
            simd::mad_f32(true, &mut x, &b, w);
            simd::mad_f32(false, &mut y, &b, w);
            assert_eq!(x, y);
        }
        let g: Vec<f32> = pseudo(1000, 11).iter().map(|x| x * 120.0).collect();
        let u = pseudo(1000, 12);
        let (mut o1, mut o2) = (vec![0f32; 1000], vec![0f32; 1000]);
        simd::silu_mul(true, &g, &u, &mut o1);
        simd::silu_mul(false, &g, &u, &mut o2);
        assert_eq!(
            o1.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            o2.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        let mut x = r16s(pseudo(d, 13));
        let mut y = x.clone();
        simd::scale_f16(true, &mut x, 0.37);
        simd::scale_f16(false, &mut y, 0.37);
        assert_eq!(x, y);
        let kt = pseudo(d * KV_TILE, 10);
        let (mut s1, mut s2) = ([0f32; KV_TILE], [0f32; KV_TILE]);
        simd::tile_scores(true, &mut s1, &kt, &a);
        simd::tile_scores(false, &mut s2, &kt, &a);
        assert_eq!(s1, s2);
    }

    /// The AVX-512 paths of OneChunk and TwoPass, and the AVX2 path of TwoPass, against their
    /// portable definitions, bit for bit: head sizes 64 and 128, GQA groups of 1..7, one row
    /// (decode) to several row blocks (prefill), and scores large enough that some weights
    /// underflow. (A path this CPU lacks falls back to the definition and compares trivially.)
    #[test]
    fn fast_matches_reference_bitwise() {
        for (d, h, kvh) in [(64, 9, 3), (64, 14, 2), (128, 12, 2), (64, 4, 4), (256, 4, 1)] {
            for (rows, pos, amp, window) in [
                (1, 1, 1.0, None),
                (1, 17, 4.0, None),
                (1, 300, 1.0, None),
                (3, 70, 30.0, None),
                (37, 200, 2.0, None),
                (5, 5, 1.0, None),
                (1, 300, 1.0, Some(1)),
                (1, 300, 3.0, Some(37)),
                (5, 90, 2.0, Some(16)),
                (37, 200, 2.0, Some(50)),
                (40, 200, 30.0, Some(7)),
            ] {
                let keys = f16s(pseudo(pos * kvh * d, 21));
                let values = f16s(pseudo(pos * kvh * d, 22));
                let q: Vec<f32> = pseudo(rows * h * d, 23).iter().map(|x| x * amp).collect();
                let blocks = KvBlocks::from_rows(&keys, &values, kvh, d);
                let kv = blocks.rows();
                let shape = AttnShape {
                    rows,
                    start: pos - rows,
                    num_heads: h,
                    num_kv_heads: kvh,
                    head_dim: d,
                    window,
                    scale: 1.0 / (d as f32).sqrt(),
                };
                let item = [AttnItem { q: &q, kv: &kv, shape }];
                for mode in [AttnMode::OneChunk, AttnMode::TwoPass] {
                    let reference = attend_with(&item, mode, Path::Reference);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    for path in [Path::Best, Path::Avx2] {
                        let fast = attend_with(&item, mode, path);
                        assert_eq!(
                            bits(&fast),
                            bits(&reference),
                            "{mode:?} {path:?} d{d} h{h}/{kvh} rows {rows} at {pos} x{amp} window {window:?}"
                        );
                    }
                }
            }
        }
    }

    /// A batch of sequences (different rows, positions and caches) gives each sequence the bits
    /// of its own call, in both modes and on both paths.
    #[test]
    fn batch_matches_separate_calls_bitwise() {
        let (h, kvh, d) = (9, 3, 64);
        let seqs: Vec<(usize, usize)> = vec![(1, 40), (5, 130), (1, 300), (20, 20), (1, 2)];
        // A window narrower than most of the sequences.
        let window = Some(33);
        let data: Vec<(Vec<f32>, Vec<half::f16>, Vec<half::f16>)> = seqs
            .iter()
            .enumerate()
            .map(|(i, &(rows, pos))| {
                let i = i as u32;
                (
                    pseudo(rows * h * d, 40 + i),
                    f16s(pseudo(pos * kvh * d, 50 + i)),
                    f16s(pseudo(pos * kvh * d, 60 + i)),
                )
            })
            .collect();
        let blocks: Vec<KvBlocks> = data.iter().map(|(_, k, v)| KvBlocks::from_rows(k, v, kvh, d)).collect();
        let kvs: Vec<KvRows<'_>> = blocks.iter().map(KvBlocks::rows).collect();
        let items: Vec<AttnItem<'_>> = seqs
            .iter()
            .zip(&data)
            .zip(&kvs)
            .map(|((&(rows, pos), (q, _, _)), kv)| AttnItem {
                q,
                kv,
                shape: AttnShape {
                    rows,
                    start: pos - rows,
                    num_heads: h,
                    num_kv_heads: kvh,
                    head_dim: d,
                    window,
                    scale: 1.0 / (d as f32).sqrt(),
                },
            })
            .collect();
        for mode in [AttnMode::TwoPass, AttnMode::OneChunk, AttnMode::Tiled] {
            for path in [Path::Best, Path::Avx2, Path::Reference] {
                let all = attend_with(&items, mode, path);
                let mut off = 0;
                for (i, it) in items.iter().enumerate() {
                    let one = attend_with(std::slice::from_ref(it), mode, path);
                    let got = &all[off..off + one.len()];
                    assert!(
                        got.iter().zip(&one).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{mode:?} {path:?} sequence {i}"
                    );
                    off += one.len();
                }
                assert_eq!(off, all.len());
            }
        }
    }

    /// A cache whose heads are not the shape's is refused before any kernel reads it (the
    /// AVX-512 passes read `head_dim` values per row through raw pointers).
    #[test]
    #[should_panic(expected = "attention: a cache of 1 heads x 32 for a shape of 1 x 64")]
    fn a_cache_of_another_head_layout_is_refused() {
        let (keys, values) = (f16s(pseudo(40 * 32, 1)), f16s(pseudo(40 * 32, 2)));
        let blocks = KvBlocks::from_rows(&keys, &values, 1, 32);
        let shape = AttnShape {
            rows: 1,
            start: 10,
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 64,
            window: None,
            scale: 0.125,
        };
        attend(&pseudo(2 * 64, 3), &blocks.rows(), &shape);
    }

    /// Wall ms of the attention of a whole SmolLM2-shaped step (30 layers, 9 heads, 3 KV heads,
    /// d = 64) at 1,800 cached positions, 1 / 5 / 9 query rows, each layer its own K/V (41 MB
    /// in all, past the last-level cache, as in a real step) and 96 MB streamed through the
    /// caches before each timed step. Run with
    /// `cargo test --release -p specula-engine --lib attention::tests::long_context_step -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn long_context_step() {
        let (h, kvh, d, layers, pos) = (9, 3, 64, 30, 1800);
        let mk = |seed: u32| f16s(pseudo(pos * kvh * d, seed));
        let caches: Vec<KvBlocks> = (0..layers)
            .map(|l| KvBlocks::from_rows(&mk(2 * l as u32 + 1), &mk(2 * l as u32 + 2), kvh, d))
            .collect();
        let mut evict = vec![0u8; 96 << 20];
        for rows in [1usize, 5, 9] {
            let q: Vec<f32> = (0..rows * h * d)
                .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
                .collect();
            let shape = AttnShape {
                rows,
                start: pos - rows,
                num_heads: h,
                num_kv_heads: kvh,
                head_dim: d,
                window: None,
                scale: 1.0 / (d as f32).sqrt(),
            };
            let mut best = f64::MAX;
            for _ in 0..8 {
                for (i, b) in evict.iter_mut().enumerate().step_by(64) {
                    *b = b.wrapping_add(i as u8);
                }
                let t = std::time::Instant::now();
                for c in &caches {
                    std::hint::black_box(attend(&q, &c.rows(), &shape));
                }
                best = best.min(t.elapsed().as_secs_f64() * 1e3);
            }
            eprintln!("{rows} rows at {pos} positions: {best:.2} ms a step (best of 8)");
        }
        std::hint::black_box(&evict);
    }

    /// ns per (query head, key) of OneChunk and TwoPass, portable vs the AVX2 and best paths, on
    /// SmolLM2's shape (9 heads, 3 KV heads, d = 64), wall time (the kernel pool's threads take
    /// part above `ATTN_PARALLEL_MIN`). Run with
    /// `cargo test --release -p specula-engine --lib attention::tests::speed -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn speed() {
        // Inside a one-thread pool, as the model calls it (no wake-ups of another thread).
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("pool");
        pool.install(speed_in_pool);
    }

    fn speed_in_pool() {
        let (h, kvh, d) = (9, 3, 64);
        for (rows, pos) in [(1, 130), (1, 1000), (9, 130), (64, 512)] {
            let keys = f16s(pseudo(pos * kvh * d, 31));
            let values = f16s(pseudo(pos * kvh * d, 32));
            let q = pseudo(rows * h * d, 33);
            let blocks = KvBlocks::from_rows(&keys, &values, kvh, d);
            let kv = blocks.rows();
            let shape = AttnShape {
                rows,
                start: pos - rows,
                num_heads: h,
                num_kv_heads: kvh,
                head_dim: d,
                window: None,
                scale: 1.0 / (d as f32).sqrt(),
            };
            let pairs = (rows * h * (pos - rows / 2)) as f64;
            let mut line = format!("rows {rows:>2} at {pos:>4}:");
            for mode in [AttnMode::OneChunk, AttnMode::TwoPass] {
                for (name, fast) in [
                    ("reference", Path::Reference),
                    ("avx2", Path::Avx2),
                    ("best", Path::Best),
                ] {
                    let iters = (2e7 / pairs).max(3.0) as usize;
                    let t = std::time::Instant::now();
                    for _ in 0..iters {
                        let item = [AttnItem { q: &q, kv: &kv, shape }];
                        std::hint::black_box(attend_with(&item, mode, fast));
                    }
                    let ns = t.elapsed().as_nanos() as f64 / iters as f64 / pairs;
                    line += &format!(" {mode:?} {name} {ns:.2} ns");
                }
            }
            eprintln!("{line}");
        }
    }

    /// The GELU table is ggml's, entry for entry: the sha256 of its 65,536 f16 values (little
    /// endian, by input bits) as ggml's expression gives them compiled by GCC 12 with `-O3
    /// -march=native` (one FMA contraction) against glibc's `tanhf`. Without the FMA one entry
    /// differs.
    #[test]
    fn gelu_table_is_ggmls() {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        for &v in gelu_table() {
            h.update(half::f16::from_f32(v).to_bits().to_le_bytes());
        }
        let hex: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, "5372503d4d69aabb589feee6b59e80bf08cbcd71ffb6c43a8210622729ad32bf");
        // Outside the table's range ggml uses 0 and the identity.
        assert_eq!(gelu_mul(&[-10.0, 10.0, 12.5], &[3.0, 3.0, 2.0]), vec![0.0, 30.0, 25.0]);
    }

    #[test]
    fn v_expf_is_close_to_exp() {
        for i in -1700..1700 {
            let x = i as f32 * 0.05;
            let (a, b) = (v_expf(x), x.exp());
            assert!((a - b).abs() <= 4.0 * f32::EPSILON * b, "{x}: {a} vs {b}");
        }
        assert_eq!(v_expf(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn matches_naive_softmax_attention() {
        let (h, kvh, d, rows) = (4, 2, 8, 5);
        let keys = f16s(pseudo(rows * kvh * d, 4));
        let values = f16s(pseudo(rows * kvh * d, 5));
        let q = pseudo(rows * h * d, 6);
        for (mode, window) in [AttnMode::TwoPass, AttnMode::OneChunk, AttnMode::Tiled]
            .into_iter()
            .flat_map(|m| [(m, None), (m, Some(2usize))])
        {
            let lo = |r: usize| window.map_or(0, |w| (r + 1).saturating_sub(w));
            let out = attend_mode(
                &q,
                &KvBlocks::from_rows(&keys, &values, kvh, d).rows(),
                &AttnShape {
                    rows,
                    start: 0,
                    num_heads: h,
                    num_kv_heads: kvh,
                    head_dim: d,
                    window,
                    scale: 1.0 / (d as f32).sqrt(),
                },
                mode,
            );
            for r in 0..rows {
                for hh in 0..h {
                    let g = hh / (h / kvh);
                    let qv = &q[(r * h + hh) * d..][..d];
                    let sc: Vec<f64> = (lo(r)..=r)
                        .map(|j| {
                            qv.iter()
                                .zip(&keys[(j * kvh + g) * d..][..d])
                                .map(|(a, b)| (*a * b.to_f32()) as f64)
                                .sum::<f64>()
                                / (d as f64).sqrt()
                        })
                        .collect();
                    let m = sc.iter().cloned().fold(f64::MIN, f64::max);
                    let z: f64 = sc.iter().map(|s| (s - m).exp()).sum();
                    for i in 0..d {
                        let want: f64 = (lo(r)..=r)
                            .zip(&sc)
                            .map(|(j, s)| (s - m).exp() / z * f64::from(values[(j * kvh + g) * d + i]))
                            .sum();
                        let got = out[(r * h + hh) * d + i] as f64;
                        // OneChunk rounds q and the running V sum to f16.
                        assert!(
                            (want - got).abs() < 3e-3,
                            "{mode:?} window {window:?} r{r} h{hh} i{i}: {want} vs {got}"
                        );
                    }
                }
            }
        }
    }
}
