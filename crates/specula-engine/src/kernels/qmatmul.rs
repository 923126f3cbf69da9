//! Batch-invariant quantized matrix multiplication for the ggml block types Q4_0, Q4_1, Q5_0,
//! Q5_1 and Q8_0 (32 weights per block).
//!
//! `y = x W^T` with `W` stored as ggml blocks (`ggml/src/ggml-common.h` layouts) and the
//! activations `x` quantized per row to Q8_0 (for Q4_0, Q5_0, Q8_0) or Q8_1 (for Q4_1, Q5_1),
//! as ggml does (`quantize_row_q8_0/q8_1`: scale `amax / 127`, values rounded to nearest-even
//! after multiplying by `127 / amax`, scales stored as f16).
//!
//! Arithmetic per output element follows ggml's x86 AVX2 dot products (`ggml_vec_dot_q*_q8_*`
//! in `ggml-cpu/arch/x86/quants.c`): per block, eight exact integer partial sums (lane `l` holds
//! the products of values `4l..4l+3`), converted to f32 and accumulated lane-wise with one fused
//! multiply-add by `d_w * d_x`; after the last block the lanes are summed in ggml's
//! `hsum_float_8` order, and for the `_1` types the `m_w * s_x` terms (accumulated separately)
//! are added.
//!
//! **Batch invariance.** Every output element is computed by the same function of one weight row
//! and one activation row, whatever the number of rows `m`: a row of an m-row product is bitwise
//! equal to the 1-row product. The AVX2 path and the portable path compute the same exact integer
//! lane sums and the same float operations, so they agree bitwise too.

use candle_core::quantized::{GgmlDType, QTensor};
use half::f16;

/// Weights per block for every type here.
pub const QK: usize = 32;

/// The block types this kernel handles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QKind {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
}

impl QKind {
    /// The kind for a candle/ggml dtype, if this kernel supports it.
    pub fn from_ggml(dt: GgmlDType) -> Option<Self> {
        Some(match dt {
            GgmlDType::Q4_0 => QKind::Q4_0,
            GgmlDType::Q4_1 => QKind::Q4_1,
            GgmlDType::Q5_0 => QKind::Q5_0,
            GgmlDType::Q5_1 => QKind::Q5_1,
            GgmlDType::Q8_0 => QKind::Q8_0,
            _ => return None,
        })
    }

    /// Bytes per block.
    pub fn block_bytes(&self) -> usize {
        match self {
            QKind::Q4_0 => 18,
            QKind::Q4_1 => 20,
            QKind::Q5_0 => 22,
            QKind::Q5_1 => 24,
            QKind::Q8_0 => 34,
        }
    }

    /// Bytes of packed quants per block.
    fn qs_bytes(&self) -> usize {
        if *self == QKind::Q8_0 {
            32
        } else {
            16
        }
    }

    /// Does the block carry a minimum `m` (the `_1` types, dotted with Q8_1 activations)?
    fn has_min(&self) -> bool {
        matches!(self, QKind::Q4_1 | QKind::Q5_1)
    }
}

/// One activation row quantized to Q8_0 / Q8_1: per block an f16-rounded scale `d`, for Q8_1
/// the f16-rounded `s = d * sum(q)`, and 32 signed bytes.
#[derive(Debug, Clone)]
pub struct QuantRow {
    pub d: Vec<f32>,
    pub s: Vec<f32>,
    pub qs: Vec<i8>,
}

/// Quantize one row of `k` floats (`k` a multiple of 32) as ggml's `quantize_row_q8_0` /
/// `quantize_row_q8_1` (x86 path: multiply by `127 / amax`, round half to even).
pub fn quantize_row(x: &[f32]) -> QuantRow {
    let nb = x.len() / QK;
    let mut d = Vec::with_capacity(nb);
    let mut s = Vec::with_capacity(nb);
    let mut qs = vec![0i8; nb * QK];
    for (b, chunk) in x.chunks_exact(QK).enumerate() {
        let amax = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let dd = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in qs[b * QK..(b + 1) * QK].iter_mut().zip(chunk) {
            let r = nearest_int(v * id);
            *q = r as i8;
            sum += r;
        }
        d.push(f16::from_f32(dd).to_f32());
        s.push(f16::from_f32(dd * sum as f32).to_f32());
    }
    QuantRow { d, s, qs }
}

/// Round half to even for |v| < 2^22, as ggml's `nearest_int` (the 1.5 * 2^23 trick) and
/// `_mm256_round_ps(_MM_ROUND_NEAREST)` do.
#[inline]
pub(crate) fn nearest_int(v: f32) -> i32 {
    let t = v + 12_582_912.0;
    (t.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// A weight matrix `[n, k]` in one of the [`QKind`] block formats, in owned memory.
#[derive(Debug, Clone)]
pub struct QWeight {
    kind: QKind,
    n: usize,
    k: usize,
    /// Per block, the scale `d` (f16 bits, as stored), `[n * k / 32]`.
    d: Vec<u16>,
    /// Per block, the minimum `m` for the `_1` types (f16 bits; else empty).
    m: Vec<u16>,
    /// Per block, the packed quants: 16 bytes of nibbles (4/5-bit types) or 32 signed bytes (Q8_0).
    qs: Vec<u8>,
    /// Per block, the fifth bits of the 5-bit types (else empty).
    qh: Vec<u32>,
}

/// A view of one weight row.
#[derive(Clone, Copy)]
pub struct RowRef<'a> {
    kind: QKind,
    d: &'a [u16],
    m: &'a [u16],
    qs: &'a [u8],
    qh: &'a [u32],
}

impl QWeight {
    /// Take a candle quantized tensor of shape `[n, k]`; `None` if its type is not handled here.
    pub fn from_qtensor(t: &QTensor) -> candle_core::Result<Option<Self>> {
        let Some(kind) = QKind::from_ggml(t.dtype()) else {
            return Ok(None);
        };
        let (n, k) = t.shape().dims2()?;
        if !k.is_multiple_of(QK) {
            return Ok(None);
        }
        let data = t.data()?;
        let nblocks = n * (k / QK);
        let bb = kind.block_bytes();
        if data.len() != nblocks * bb {
            candle_core::bail!("quantized tensor holds {} bytes, expected {}", data.len(), nblocks * bb);
        }
        let qs_len = kind.qs_bytes();
        let mut w = Self {
            kind,
            n,
            k,
            d: Vec::with_capacity(nblocks),
            m: Vec::new(),
            qs: Vec::with_capacity(nblocks * qs_len),
            qh: Vec::new(),
        };
        for b in data.chunks_exact(bb) {
            w.d.push(u16::from_le_bytes([b[0], b[1]]));
            let mut at = 2;
            if kind.has_min() {
                w.m.push(u16::from_le_bytes([b[2], b[3]]));
                at = 4;
            }
            if matches!(kind, QKind::Q5_0 | QKind::Q5_1) {
                w.qh.push(u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]));
                at += 4;
            }
            w.qs.extend_from_slice(&b[at..at + qs_len]);
        }
        Ok(Some(w))
    }

    pub fn kind(&self) -> QKind {
        self.kind
    }

    /// `(n, k)`: output features, input features.
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// Weight row `j`.
    pub fn row(&self, j: usize) -> RowRef<'_> {
        let nb = self.k / QK;
        let ql = self.kind.qs_bytes();
        RowRef {
            kind: self.kind,
            d: &self.d[j * nb..(j + 1) * nb],
            m: if self.m.is_empty() {
                &[]
            } else {
                &self.m[j * nb..(j + 1) * nb]
            },
            qs: &self.qs[j * nb * ql..(j + 1) * nb * ql],
            qh: if self.qh.is_empty() {
                &[]
            } else {
                &self.qh[j * nb..(j + 1) * nb]
            },
        }
    }

    /// `x`: `[m, k]` row-major f32 → `[m, n]` row-major f32.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        assert_eq!(
            x.len(),
            m * self.k,
            "matmul: x has {} floats, expected {m} x {}",
            x.len(),
            self.k
        );
        let rows: Vec<QuantRow> = x.chunks_exact(self.k).map(quantize_row).collect();
        let avx2 = has_avx2();
        super::run_rows(self.n, self.k, &rows, 4, |j, xs, out| {
            if let Ok(x4) = <[&QuantRow; 4]>::try_from(xs) {
                out.copy_from_slice(&vec_dot4(self.row(j), x4, avx2));
            } else {
                for (o, x) in out.iter_mut().zip(xs) {
                    *o = vec_dot(self.row(j), x, avx2);
                }
            }
        })
    }
}

/// AVX2 + FMA + F16C available at run time (the SIMD paths need all three).
pub(crate) fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// ggml's `hsum_float_8`: ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)).
#[inline]
pub(crate) fn hsum8(a: &[f32; 8]) -> f32 {
    let r = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    let r0 = r[0] + r[2];
    let r1 = r[1] + r[3];
    r0 + r1
}

/// Expand block `b` of a row to 32 integer values (value index = position in the block).
#[inline]
fn expand_block(w: &RowRef<'_>, b: usize, v: &mut [i32; 32]) {
    match w.kind {
        QKind::Q4_0 | QKind::Q4_1 => {
            let bias = if w.kind == QKind::Q4_0 { 8 } else { 0 };
            for j in 0..16 {
                let q = w.qs[b * 16 + j];
                v[j] = (q & 0x0F) as i32 - bias;
                v[j + 16] = (q >> 4) as i32 - bias;
            }
        }
        QKind::Q5_0 | QKind::Q5_1 => {
            let bias = if w.kind == QKind::Q5_0 { 16 } else { 0 };
            let qh = w.qh[b];
            for j in 0..16 {
                let q = w.qs[b * 16 + j];
                let h0 = ((qh >> j) & 1) as i32;
                let h1 = ((qh >> (j + 16)) & 1) as i32;
                v[j] = ((q & 0x0F) as i32 | (h0 << 4)) - bias;
                v[j + 16] = ((q >> 4) as i32 | (h1 << 4)) - bias;
            }
        }
        QKind::Q8_0 => {
            for (j, x) in v.iter_mut().enumerate() {
                *x = w.qs[b * 32 + j] as i8 as i32;
            }
        }
    }
}

/// Dot product of one weight row with one quantized activation row.
#[inline]
pub fn vec_dot(w: RowRef<'_>, x: &QuantRow, avx2: bool) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // SAFETY: AVX2, FMA and F16C were detected at run time.
        return unsafe { avx2_impl::vec_dot(w, x) };
    }
    let _ = avx2;
    vec_dot_portable(w, x)
}

/// Four activation rows against one weight row; each result is bitwise [`vec_dot`]'s.
#[inline]
pub fn vec_dot4(w: RowRef<'_>, x: [&QuantRow; 4], avx2: bool) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // SAFETY: AVX2, FMA and F16C were detected at run time.
        return unsafe { avx2_impl::vec_dot4(w, x) };
    }
    let _ = avx2;
    x.map(|xr| vec_dot_portable(w, xr))
}

/// The portable reference: the same integer lane sums and float operations as the AVX2 path.
pub fn vec_dot_portable(w: RowRef<'_>, x: &QuantRow) -> f32 {
    let mut acc = [0f32; 8];
    let mut summs = 0f32;
    let mut v = [0i32; 32];
    for b in 0..w.d.len() {
        expand_block(&w, b, &mut v);
        let qx = &x.qs[b * QK..(b + 1) * QK];
        let d = f16::from_bits(w.d[b]).to_f32() * x.d[b];
        if w.kind.has_min() {
            summs = f16::from_bits(w.m[b]).to_f32().mul_add(x.s[b], summs);
        }
        for (l, a) in acc.iter_mut().enumerate() {
            let mut s = 0i32;
            for t in 0..4 {
                s += v[4 * l + t] * qx[4 * l + t] as i32;
            }
            *a = (s as f32).mul_add(d, *a);
        }
    }
    hsum8(&acc) + summs
}

#[cfg(target_arch = "x86_64")]
mod avx2_impl {
    use super::*;
    use std::arch::x86_64::*;

    /// 32 bytes: the low nibbles of `qs[0..16]`, then the high nibbles.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn nibbles(qs: *const u8) -> __m256i {
        let tmp = _mm_loadu_si128(qs as *const __m128i);
        let hi = _mm_srli_epi16(tmp, 4);
        let both = _mm256_insertf128_si256(_mm256_castsi128_si256(tmp), hi, 1);
        _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
    }

    /// 32 bytes, byte j = 0xFF if bit j of `qh` is set (ggml's `bytes_from_bits_32`).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn bits(qh: u32) -> __m256i {
        let shuf = _mm256_setr_epi64x(
            0x0000000000000000,
            0x0101010101010101,
            0x0202020202020202,
            0x0303030303030303,
        );
        let r = _mm256_shuffle_epi8(_mm256_set1_epi32(qh as i32), shuf);
        let mask = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe_u64 as i64);
        let r = _mm256_or_si256(r, mask);
        _mm256_cmpeq_epi8(r, _mm256_set1_epi64x(-1))
    }

    /// Lane sums of unsigned `a` (0..=255) times signed `b`, as 8 × f32 (exact).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn us8_pairs(a: __m256i, b: __m256i) -> __m256 {
        let dot16 = _mm256_maddubs_epi16(a, b);
        _mm256_cvtepi32_ps(_mm256_madd_epi16(dot16, _mm256_set1_epi16(1)))
    }

    /// Lane sums of signed `a` times signed `b`, as 8 × f32 (exact).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn i8_pairs(a: __m256i, b: __m256i) -> __m256 {
        let ax = _mm256_sign_epi8(a, a);
        let sy = _mm256_sign_epi8(b, a);
        us8_pairs(ax, sy)
    }

    /// f16 bits → f32 with F16C (exact, like `half`).
    #[inline]
    #[target_feature(enable = "f16c")]
    unsafe fn h2f(h: u16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
    }

    /// The weight block's 32 values as bytes for the integer product, and whether they are
    /// signed (`i8_pairs`) or unsigned (`us8_pairs`).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load_block(w: &RowRef<'_>, b: usize) -> (__m256i, bool) {
        let qs = w.qs.as_ptr();
        match w.kind {
            QKind::Q4_0 => (_mm256_sub_epi8(nibbles(qs.add(b * 16)), _mm256_set1_epi8(8)), true),
            QKind::Q4_1 => (nibbles(qs.add(b * 16)), false),
            QKind::Q5_0 => {
                let hi = _mm256_andnot_si256(bits(*w.qh.get_unchecked(b)), _mm256_set1_epi8(0xF0u8 as i8));
                (_mm256_or_si256(nibbles(qs.add(b * 16)), hi), true)
            }
            QKind::Q5_1 => {
                let hi = _mm256_and_si256(bits(*w.qh.get_unchecked(b)), _mm256_set1_epi8(0x10));
                (_mm256_or_si256(nibbles(qs.add(b * 16)), hi), false)
            }
            QKind::Q8_0 => (_mm256_loadu_si256(qs.add(b * 32) as *const __m256i), true),
        }
    }

    /// Four activation rows against one weight row: per (row, block) exactly the operations of
    /// [`vec_dot`], with the weight block unpacked once.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot4(w: RowRef<'_>, x: [&QuantRow; 4]) -> [f32; 4] {
        let nb = w.d.len();
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut summs = [0f32; 4];
        let has_min = w.kind.has_min();
        for b in 0..nb {
            let (qx, signed) = load_block(&w, b);
            let dw = h2f(*w.d.get_unchecked(b));
            let mw = if has_min { h2f(*w.m.get_unchecked(b)) } else { 0.0 };
            for r in 0..4 {
                let xr = x[r];
                let qy = _mm256_loadu_si256(xr.qs.as_ptr().add(b * QK) as *const __m256i);
                let d = _mm256_set1_ps(dw * *xr.d.get_unchecked(b));
                if has_min {
                    summs[r] = mw.mul_add(*xr.s.get_unchecked(b), summs[r]);
                }
                let q = if signed { i8_pairs(qx, qy) } else { us8_pairs(qx, qy) };
                acc[r] = _mm256_fmadd_ps(q, d, acc[r]);
            }
        }
        let mut out = [0f32; 4];
        for r in 0..4 {
            let mut lanes = [0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), acc[r]);
            out[r] = hsum8(&lanes) + summs[r];
        }
        out
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn vec_dot(w: RowRef<'_>, x: &QuantRow) -> f32 {
        let nb = w.d.len();
        let mut acc = _mm256_setzero_ps();
        let mut summs = 0f32;
        let qs = w.qs.as_ptr();
        let xq = x.qs.as_ptr();
        for b in 0..nb {
            let qy = _mm256_loadu_si256(xq.add(b * QK) as *const __m256i);
            let d = _mm256_set1_ps(h2f(*w.d.get_unchecked(b)) * *x.d.get_unchecked(b));
            let q = match w.kind {
                QKind::Q4_0 => {
                    let qx = _mm256_sub_epi8(nibbles(qs.add(b * 16)), _mm256_set1_epi8(8));
                    i8_pairs(qx, qy)
                }
                QKind::Q4_1 => {
                    summs = h2f(*w.m.get_unchecked(b)).mul_add(*x.s.get_unchecked(b), summs);
                    us8_pairs(nibbles(qs.add(b * 16)), qy)
                }
                QKind::Q5_0 => {
                    let hi = _mm256_andnot_si256(bits(*w.qh.get_unchecked(b)), _mm256_set1_epi8(0xF0u8 as i8));
                    let qx = _mm256_or_si256(nibbles(qs.add(b * 16)), hi);
                    i8_pairs(qx, qy)
                }
                QKind::Q5_1 => {
                    summs = h2f(*w.m.get_unchecked(b)).mul_add(*x.s.get_unchecked(b), summs);
                    let hi = _mm256_and_si256(bits(*w.qh.get_unchecked(b)), _mm256_set1_epi8(0x10));
                    let qx = _mm256_or_si256(nibbles(qs.add(b * 16)), hi);
                    us8_pairs(qx, qy)
                }
                QKind::Q8_0 => {
                    let qx = _mm256_loadu_si256(qs.add(b * 32) as *const __m256i);
                    i8_pairs(qx, qy)
                }
            };
            acc = _mm256_fmadd_ps(q, d, acc);
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        hsum8(&lanes) + summs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    fn pseudo(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
            })
            .collect()
    }

    fn weight(dt: GgmlDType, n: usize, k: usize) -> (QTensor, Vec<f32>) {
        let w = Tensor::from_vec(pseudo(n * k, 3), (n, k), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, dt).unwrap();
        let deq = q
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        (q, deq)
    }

    const KINDS: [GgmlDType; 5] = [
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
        GgmlDType::Q8_0,
    ];

    #[test]
    fn close_to_dequantized_product() {
        let (n, k, m) = (40, 256, 3);
        let x = pseudo(m * k, 9);
        for dt in KINDS {
            let (q, deq) = weight(dt, n, k);
            let w = QWeight::from_qtensor(&q).unwrap().unwrap();
            let y = w.matmul(&x, m);
            for i in 0..m {
                for j in 0..n {
                    let want: f32 = (0..k).map(|t| x[i * k + t] * deq[j * k + t]).sum();
                    let got = y[i * n + j];
                    // Q8 activation rounding: relative error ~1% of the row norm.
                    assert!(
                        (want - got).abs() < 0.05 * (k as f32).sqrt(),
                        "{dt:?} [{i},{j}] {want} vs {got}"
                    );
                }
            }
        }
    }

    #[test]
    fn rows_are_batch_invariant_and_paths_agree() {
        let (n, k) = (48, 128);
        for dt in KINDS {
            let (q, _) = weight(dt, n, k);
            let w = QWeight::from_qtensor(&q).unwrap().unwrap();
            for m in [2usize, 5, 9, 17] {
                let x = pseudo(m * k, m as u64);
                let many = w.matmul(&x, m);
                for i in 0..m {
                    let one = w.matmul(&x[i * k..(i + 1) * k], 1);
                    let a: Vec<u32> = many[i * n..(i + 1) * n].iter().map(|v| v.to_bits()).collect();
                    let b: Vec<u32> = one.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(a, b, "{dt:?} m={m} row {i}");
                }
            }
            let qr = quantize_row(&pseudo(k, 77));
            for j in 0..n {
                let p = vec_dot_portable(w.row(j), &qr);
                let f = vec_dot(w.row(j), &qr, has_avx2());
                assert_eq!(
                    p.to_bits(),
                    f.to_bits(),
                    "{dt:?} row {j}: portable and SIMD paths differ"
                );
            }
        }
    }

    #[test]
    fn nearest_int_is_round_half_even() {
        for v in [
            -127.5f32, -63.5, -2.5, -1.5, -0.5, -0.49, 0.0, 0.5, 1.5, 2.5, 3.7, 126.5, 127.0,
        ] {
            assert_eq!(nearest_int(v), v.round_ties_even() as i32, "{v}");
        }
    }

    #[test]
    fn q8_quantization_matches_ggml_definition() {
        let mut x = vec![0f32; 32];
        x[0] = 127.0;
        x[1] = -63.5; // ties to even -> -64
        x[2] = 0.5; // -> 0
        x[3] = 1.5; // -> 2
        x[4] = 2.5; // -> 2
        let q = quantize_row(&x);
        assert_eq!(&q.qs[..5], &[127, -64, 0, 2, 2]);
        assert_eq!(q.d[0], 1.0);
        assert_eq!(q.s[0], 127.0 - 64.0 + 2.0 + 2.0);
    }
}
