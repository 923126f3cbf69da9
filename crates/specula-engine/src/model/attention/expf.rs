//! `expf` with glibc's arithmetic, bit for bit, scalar and 8 lanes at a time (AVX-512, or AVX2).
//!
//! llama.cpp's CPU attention (`flash_attn_ext_f16_one_chunk`) calls the C library's `expf` once
//! per (query, key). Specula reproduces that attention exactly (module docs of
//! [`super`]), so its exponential must give the bits glibc's gives. Owning the function keeps
//! the bits the same on every machine (another libm would round differently in rare cases) and
//! lets the attention compute eight at once.
//!
//! The algorithm is glibc's `__expf` (since glibc 2.27; from Arm's optimized-routines, Szabolcs
//! Nagy 2017), in the variant the x86-64 FMA build runs (`__expf_fma`, selected at load time on
//! any CPU with FMA): with `N = 32`, `x·N/ln2 = k + r` (`k` rounded to an integer by the
//! `0x1.8p52` shift trick, `r` from one fused multiply-subtract), `2^(k/N)` from a 32-entry
//! table with `k / N` added to the exponent, and `2^(r/N) ≈ 1 + C2·r + C1·r² + C0·r³` in f64,
//! rounded to f32 once. Outside `|x| < 88` the special cases of glibc apply (`-inf` → 0,
//! overflow → `inf`, underflow → 0 or the smallest subnormal, NaN → NaN).
//!
//! `tests::matches_libm_exhaustively` (ignored: ~1 minute) compares every f32 against the C
//! library; it passed against glibc 2.36 (Debian 12) on the development machine.

/// `tab[i] = bits(2^(i/32)) - (i << 47)`: 2^(i/32) rounded to f64, with `i/32` taken back out
/// of the exponent field so that adding `k << 47` for any integer `k` gives `2^(k/32)`.
const TAB: [u64; 32] = [
    0x3ff0000000000000,
    0x3fefd9b0d3158574,
    0x3fefb5586cf9890f,
    0x3fef9301d0125b51,
    0x3fef72b83c7d517b,
    0x3fef54873168b9aa,
    0x3fef387a6e756238,
    0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715,
    0x3feef1a7373aa9cb,
    0x3feedea64c123422,
    0x3feece086061892d,
    0x3feebfdad5362a27,
    0x3feeb42b569d4f82,
    0x3feeab07dd485429,
    0x3feea47eb03a5585,
    0x3feea09e667f3bcd,
    0x3fee9f75e8ec5f74,
    0x3feea11473eb0187,
    0x3feea589994cce13,
    0x3feeace5422aa0db,
    0x3feeb737b0cdc5e5,
    0x3feec49182a3f090,
    0x3feed503b23e255d,
    0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47,
    0x3fef199bdd85529c,
    0x3fef3720dcef9069,
    0x3fef5818dcfba487,
    0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da,
    0x3fefd0765b6e4540,
];

/// 32 / ln 2.
const INV_LN2_N: f64 = f64::from_bits(0x4047_1547_652b_82fe);
/// `0x1.8p52`: adding it rounds an f64 of magnitude < 2^51 to an integer held in the low bits.
const SHIFT: f64 = f64::from_bits(0x4338_0000_0000_0000);
/// Coefficients of `2^(r/32)` in `r` (cubic, then quadratic, then linear).
const C0: f64 = f64::from_bits(0x3ebc_6af8_4b91_2394);
const C1: f64 = f64::from_bits(0x3f2e_bfce_50fa_c4f3);
const C2: f64 = f64::from_bits(0x3f96_2e42_ff0c_52d6);
/// `top12(88.0)`: at or above it, `|x|` takes the special-case path.
const TOP12_88: u32 = 0x42b;

/// `e^x` rounded as glibc's `expf` rounds it (module docs).
#[inline]
pub fn expf(x: f32) -> f32 {
    let abstop = (x.to_bits() >> 20) & 0x7ff;
    if abstop >= TOP12_88 {
        return special(x, abstop);
    }
    core(x)
}

/// The main path of [`expf`], for `|x| < 88`.
#[inline(always)]
fn core(x: f32) -> f32 {
    let xd = x as f64;
    let kd = INV_LN2_N.mul_add(xd, SHIFT);
    let ki = kd.to_bits();
    let kd = kd - SHIFT;
    let r = INV_LN2_N.mul_add(xd, -kd);
    let t = TAB[(ki % 32) as usize].wrapping_add(ki << 47);
    let s = f64::from_bits(t);
    let z = r.mul_add(C0, C1);
    let r2 = r * r;
    let y = r.mul_add(C2, 1.0);
    let y = z.mul_add(r2, y);
    (y * s) as f32
}

/// glibc's special cases of `expf` (`|x| >= 88`, infinities, NaN).
#[cold]
fn special(x: f32, abstop: u32) -> f32 {
    if x == f32::NEG_INFINITY {
        return 0.0;
    }
    if abstop >= 0x7f8 {
        return x + x; // +inf or NaN
    }
    if x > f32::from_bits(0x42b1_7217) {
        return f32::INFINITY; // __math_oflowf: 0x1p97f * 0x1p97f
    }
    if x < f32::from_bits(0xc2cf_f1b4) {
        return 0.0; // __math_uflowf: 0x1p-95f * 0x1p-95f
    }
    if x < f32::from_bits(0xc2ce_8ecf) {
        // __math_may_uflowf: 0x1.4p-75f * 0x1.4p-75f, the smallest subnormal.
        let y = f32::from_bits(0x1a20_0000);
        return y * y;
    }
    core(x)
}

/// [`expf`] of 8 lanes, for CPUs with AVX-512F (the caller checks).
///
/// # Safety
/// The CPU supports AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub unsafe fn expf8(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // Lanes with |x| >= 88 (or inf, NaN) go through the scalar special cases.
    let abstop = _mm256_and_si256(
        _mm256_srli_epi32::<20>(_mm256_castps_si256(x)),
        _mm256_set1_epi32(0x7ff),
    );
    let special = _mm256_cmpgt_epi32(abstop, _mm256_set1_epi32(TOP12_88 as i32 - 1));
    let xd = _mm512_cvtps_pd(x);
    let inv = _mm512_set1_pd(INV_LN2_N);
    let shift = _mm512_set1_pd(SHIFT);
    let kd = _mm512_fmadd_pd(inv, xd, shift);
    let ki = _mm512_castpd_si512(kd);
    let kd = _mm512_sub_pd(kd, shift);
    let r = _mm512_fmsub_pd(inv, xd, kd);
    // TAB[ki % 32]: two 16-entry two-register permutes, picked by bit 4 of the index.
    let tab = TAB.as_ptr() as *const i64;
    let lo = _mm512_permutex2var_epi64(_mm512_loadu_epi64(tab), ki, _mm512_loadu_epi64(tab.add(8)));
    let hi = _mm512_permutex2var_epi64(_mm512_loadu_epi64(tab.add(16)), ki, _mm512_loadu_epi64(tab.add(24)));
    let bit4 = _mm512_test_epi64_mask(ki, _mm512_set1_epi64(16));
    let t = _mm512_mask_blend_epi64(bit4, lo, hi);
    let s = _mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_slli_epi64::<47>(ki)));
    let z = _mm512_fmadd_pd(r, _mm512_set1_pd(C0), _mm512_set1_pd(C1));
    let r2 = _mm512_mul_pd(r, r);
    let y = _mm512_fmadd_pd(r, _mm512_set1_pd(C2), _mm512_set1_pd(1.0));
    let y = _mm512_fmadd_pd(z, r2, y);
    let out = _mm512_cvtpd_ps(_mm512_mul_pd(y, s));
    special_lanes(x, out, special)
}

/// `out` with the lanes flagged in `special` (all ones: `|x| >= 88`, inf or NaN) replaced by
/// the scalar [`expf`] of `x`, which handles glibc's special cases.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn special_lanes(
    x: std::arch::x86_64::__m256,
    out: std::arch::x86_64::__m256,
    special: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let mask = _mm256_movemask_ps(_mm256_castsi256_ps(special));
    if mask == 0 {
        return out;
    }
    let mut xs = [0f32; 8];
    let mut os = [0f32; 8];
    _mm256_storeu_ps(xs.as_mut_ptr(), x);
    _mm256_storeu_ps(os.as_mut_ptr(), out);
    for l in 0..8 {
        if mask & (1 << l) != 0 {
            os[l] = expf(xs[l]);
        }
    }
    _mm256_loadu_ps(os.as_ptr())
}

/// [`expf8`] with AVX2 and FMA only: the same f64 operations four lanes at a time, the table
/// read by a gather, so the same bits.
///
/// # Safety
/// The CPU supports AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn expf8_avx2(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let abstop = _mm256_and_si256(
        _mm256_srli_epi32::<20>(_mm256_castps_si256(x)),
        _mm256_set1_epi32(0x7ff),
    );
    let special = _mm256_cmpgt_epi32(abstop, _mm256_set1_epi32(TOP12_88 as i32 - 1));
    let inv = _mm256_set1_pd(INV_LN2_N);
    let shift = _mm256_set1_pd(SHIFT);
    let half = |xd: __m256d| -> __m128 {
        let kd = _mm256_fmadd_pd(inv, xd, shift);
        let ki = _mm256_castpd_si256(kd);
        let kd = _mm256_sub_pd(kd, shift);
        let r = _mm256_fmsub_pd(inv, xd, kd);
        let idx = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
        let t = _mm256_i64gather_epi64::<8>(TAB.as_ptr() as *const i64, idx);
        let s = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64::<47>(ki)));
        let z = _mm256_fmadd_pd(r, _mm256_set1_pd(C0), _mm256_set1_pd(C1));
        let r2 = _mm256_mul_pd(r, r);
        let y = _mm256_fmadd_pd(r, _mm256_set1_pd(C2), _mm256_set1_pd(1.0));
        let y = _mm256_fmadd_pd(z, r2, y);
        _mm256_cvtpd_ps(_mm256_mul_pd(y, s))
    };
    let lo = half(_mm256_cvtps_pd(_mm256_castps256_ps128(x)));
    let hi = half(_mm256_cvtps_pd(_mm256_extractf128_ps::<1>(x)));
    let out = _mm256_insertf128_ps::<1>(_mm256_castps128_ps256(lo), hi);
    special_lanes(x, out, special)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Inputs over the whole range, the special-case boundaries and their neighbours.
    fn probes() -> Vec<f32> {
        let mut xs: Vec<f32> = Vec::new();
        let mut b: u32 = 0x9e37_79b9;
        for _ in 0..200_000 {
            b ^= b << 13;
            b ^= b >> 17;
            b ^= b << 5;
            xs.push(f32::from_bits(b));
            // Most attention arguments are in [-30, 0].
            xs.push(-((b >> 8) as f32) / (1u32 << 24) as f32 * 30.0);
        }
        for edge in [
            0x42b1_7217u32,
            0xc2cf_f1b4,
            0xc2ce_8ecf,
            0x42b0_0000,
            0xc2b0_0000,
            0,
            0x8000_0000,
        ] {
            for dx in 0..8u32 {
                xs.push(f32::from_bits(edge.wrapping_add(dx)));
                xs.push(f32::from_bits(edge.wrapping_sub(dx)));
            }
        }
        xs.extend([f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 1.0, -1.0, 0.5, -0.5]);
        xs
    }

    /// Values of glibc 2.36's `expf` (x86-64, FMA variant), recorded on the development
    /// machine: this machine's libm is not consulted, so a CI image with another libm still
    /// checks our own bits.
    #[test]
    fn known_values() {
        for (x, want) in [
            (0x0000_0000u32, 0x3f80_0000u32),
            (0x3f80_0000, 0x402d_f854),
            (0xbf80_0000, 0x3ebc_5ab2),
            (0xc120_0000, 0x383e_6bce),
            (0xc1f0_0000, 0x29d2_b706),
            (0xbdcc_cccd, 0x3f67_a36d),
            (0x42b0_0000, 0x7ef8_82b7),
            (0xc2b0_0000, 0x0041_edc4),
            (0xc2ce_0000, 0x0000_0001),
            (0xc2ce_8ecf, 0x0000_0001),
            (0xc2cf_0000, 0x0000_0001),
            (0xc2d0_0000, 0x0000_0000),
            (0x42b2_0000, 0x7f80_0000),
            (0xff80_0000, 0x0000_0000),
        ] {
            assert_eq!(expf(f32::from_bits(x)).to_bits(), want, "expf({})", f32::from_bits(x));
        }
        assert!(expf(f32::NAN).is_nan());
    }

    #[test]
    fn table_is_two_to_the_i_over_32() {
        for (i, &t) in TAB.iter().enumerate() {
            let v = f64::from_bits(t + ((i as u64) << 47));
            let want = (i as f64 / 32.0).exp2();
            assert!((v - want).abs() <= f64::EPSILON * want, "{i}: {v} vs {want}");
        }
    }

    #[test]
    fn close_to_libm_and_vector_equals_scalar() {
        let xs = probes();
        for &x in &xs {
            let (a, b) = (expf(x), x.exp());
            if b.is_nan() {
                assert!(a.is_nan());
            } else {
                // Within one ulp of the C library's (equal on glibc 2.36; see module docs).
                let ulp = (a.to_bits() as i64 - b.to_bits() as i64).abs();
                assert!(ulp <= 1, "expf({x:e}) = {a:e}, libm {b:e}");
            }
        }
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx512f") {
            use std::arch::x86_64::*;
            for c in xs.chunks_exact(8) {
                let mut got = [0f32; 8];
                // SAFETY: AVX-512F detected above; the arrays hold 8 lanes.
                unsafe { _mm256_storeu_ps(got.as_mut_ptr(), expf8(_mm256_loadu_ps(c.as_ptr()))) };
                for (l, &x) in c.iter().enumerate() {
                    assert_eq!(got[l].to_bits(), expf(x).to_bits(), "lane {l}: expf8({x:e})");
                }
            }
        }
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            use std::arch::x86_64::*;
            for c in xs.chunks_exact(8) {
                let mut got = [0f32; 8];
                // SAFETY: AVX2 and FMA detected above; the arrays hold 8 lanes.
                unsafe { _mm256_storeu_ps(got.as_mut_ptr(), expf8_avx2(_mm256_loadu_ps(c.as_ptr()))) };
                for (l, &x) in c.iter().enumerate() {
                    assert_eq!(got[l].to_bits(), expf(x).to_bits(), "lane {l}: expf8_avx2({x:e})");
                }
            }
        }
    }

    /// Every f32 against the C library's `expf` (bitwise). Run with `--ignored`; it states
    /// what the module docs claim for the machine it runs on.
    #[test]
    #[ignore]
    fn matches_libm_exhaustively() {
        use rayon::prelude::*;
        let bad: u64 = (0u32..=u16::MAX as u32)
            .into_par_iter()
            .map(|hi| {
                let mut n = 0u64;
                for lo in 0..=u16::MAX as u32 {
                    let x = f32::from_bits(hi << 16 | lo);
                    let (a, b) = (expf(x), x.exp());
                    if a.to_bits() != b.to_bits() && !(a.is_nan() && b.is_nan()) {
                        if n == 0 {
                            eprintln!("expf({x:e}) = {a:e}, libm {b:e}");
                        }
                        n += 1;
                    }
                }
                n
            })
            .sum();
        assert_eq!(bad, 0, "inputs where expf differs from the C library");
    }
}
