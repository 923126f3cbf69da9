//! Batch-invariant quantized matrix multiplication for the ggml block types Q4_0, Q4_1, Q5_0,
//! Q5_1 and Q8_0 (32 weights per block).
//!
//! `y = x W^T` with `W` read from ggml blocks (`ggml/src/ggml-common.h` layouts) and the
//! activations `x` quantized per row to Q8_0 (for Q4_0, Q5_0, Q8_0) or Q8_1 (for Q4_1, Q5_1),
//! as ggml does (`quantize_row_q8_0/q8_1`: scale `amax / 127`, values rounded to nearest-even
//! after multiplying by `127 / amax`, scales stored as f16).
//!
//! **Arithmetic** (one output element, weight row `j`, activation row `i`): per block `b`, in
//! block order, starting from `acc = 0`,
//!
//! ```text
//! isum = sum over the block's 32 values of q_w * q_x          (exact i32)
//! acc  = fma(f32(isum), d_w * d_x, acc)                        (d_w * d_x rounded to f32 once)
//! acc  = fma(m_w, s_x, acc)                                    (Q4_1 / Q5_1 only)
//! ```
//!
//! and `y = acc`. `q_w` is the signed weight value (Q4_0: nibble - 8, Q5_0: 5-bit - 16, Q8_0:
//! the byte; Q4_1 / Q5_1: the unsigned value, with the minimum `m_w` carried by the second FMA).
//! The integer sum of a block is exact however it is computed, so every kernel is free in how it
//! forms it; the float steps are one chain per output in block order. This differs from ggml's
//! AVX2 dot products, which keep eight float lanes per output (one FMA per lane and block, then
//! `hsum_float_8`) and a separate `m * s` sum: that is eight times the float work per output, the
//! cost that kept the multi-row tile slow. Against llama.cpp the results differ only by rounding
//! (`tests/reference.rs` measures it on the real models).
//!
//! **Layout.** [`QWeight`] keeps the weights interleaved by [`GROUP`] rows: per group of 16 rows
//! and block, the quants as `[dword][row][4 bytes]` (dword `t` of a row holds its quant bytes
//! `4t .. 4t + 3`), then the 16 rows' scales (and minimums, and Q5's high-bit words). One 512-bit
//! load is then one dword of all 16 rows, and a `vpdpbusd` against the matching 4 activation bytes
//! broadcast adds 4 products to each row's block sum: lanes are output features, so the float
//! steps run once per (16 features, activation row, block) instead of per feature. A group and its
//! blocks are one contiguous stream for the decode step.
//!
//! **Paths.** The portable path ([`QWeight::dot_portable`]) is the definition; the AVX2 path runs
//! 8 weight rows per register (`maddubs` + `madd` block sums); the AVX-512 VNNI path
//! (`vnni_impl`) runs 16 weight rows per register times up to [`VNNI_ROWS`] activation rows (32
//! weight rows for one row). `SPECULA_KERNELS=avx2` / `=portable` force the other paths.
//!
//! **Batch invariance.** Every output element is computed by the same function of one weight row
//! and one activation row, whatever the number of rows `m`: a row of an m-row product is bitwise
//! equal to the 1-row product. All paths compute the same exact block sums and the same float
//! operations in the same order, so they agree bitwise too (tested).

use candle_core::quantized::{GgmlDType, QTensor};
use half::f16;

/// Weights per block for every type here.
pub const QK: usize = 32;

/// Weight rows per interleaved group of [`QWeight`] (the lanes of one 512-bit register).
pub const GROUP: usize = 16;

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

    /// Bytes per ggml block.
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

    /// Do the blocks carry a fifth bit per value?
    fn has_qh(&self) -> bool {
        matches!(self, QKind::Q5_0 | QKind::Q5_1)
    }

    /// What the kernels add to a weight value to make it unsigned (`vpdpbusd` multiplies
    /// unsigned weight bytes by signed activation bytes); the block sum is corrected by
    /// `-bias * sum(q_x)`, exactly.
    fn bias(&self) -> i32 {
        match self {
            QKind::Q4_0 => 8,
            QKind::Q5_0 => 16,
            QKind::Q8_0 => 128,
            QKind::Q4_1 | QKind::Q5_1 => 0,
        }
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
///
/// On AVX-512 the blocks are quantized 16 lanes at a time (`quantize_block_avx512`), on AVX2
/// 8 at a time ([`quant_avx2::quantize_block`]): the same maximum, the same scalar
/// `127 / amax`, the same per-value product and round half to even, so the same bytes
/// (`simd_quantization_matches_scalar`, every input).
/// The activations of a forward are quantized on the thread that waits for the kernel pool, so
/// this is serial time.
pub fn quantize_row(x: &[f32]) -> QuantRow {
    let nb = x.len() / QK;
    let mut d = Vec::with_capacity(nb);
    let mut s = Vec::with_capacity(nb);
    let mut qs = vec![0i8; nb * QK];
    #[cfg(target_arch = "x86_64")]
    let (avx512, avx2) = (super::kquants::has_avx512(), has_avx2());
    for (b, chunk) in x.chunks_exact(QK).enumerate() {
        let q = &mut qs[b * QK..(b + 1) * QK];
        #[cfg(target_arch = "x86_64")]
        let (dd, sum) = if avx512 {
            // SAFETY: AVX-512 F was detected at run time; `chunk` and `q` hold 32 values.
            unsafe { quantize_block_avx512(chunk, q) }
        } else if avx2 {
            // SAFETY: AVX2 was detected at run time; `chunk` and `q` hold 32 values.
            unsafe { quant_avx2::quantize_block(chunk, q) }
        } else {
            quantize_block(chunk, q)
        };
        #[cfg(not(target_arch = "x86_64"))]
        let (dd, sum) = quantize_block(chunk, q);
        d.push(f16::from_f32(dd).to_f32());
        s.push(f16::from_f32(dd * sum as f32).to_f32());
    }
    QuantRow { d, s, qs }
}

/// One block of [`quantize_row`]: the quants into `q`, and `(amax / 127, sum of the quants)`.
fn quantize_block(chunk: &[f32], q: &mut [i8]) -> (f32, i32) {
    let amax = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
    let dd = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0i32;
    for (q, &v) in q.iter_mut().zip(chunk) {
        let r = nearest_int(v * id);
        *q = r as i8;
        sum += r;
    }
    (dd, sum)
}

/// [`quantize_block`] in two 16-lane registers, the same bytes and sum for every input: `max`
/// of the absolute values is exact in any order and skips NaN lanes as `f32::max` does
/// ([`quant_avx512::max_abs`]), the rounding is the scalar's [`nearest_int`] lane by lane
/// ([`quant_avx512::nearest_int`], not `vcvtps2dq`), and `vpmovdb` keeps each lane's low byte
/// as the scalar's `as i8` does.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn quantize_block_avx512(chunk: &[f32], q: &mut [i8]) -> (f32, i32) {
    use quant_avx512::{max_abs, nearest_int};
    use std::arch::x86_64::*;
    assert!(chunk.len() == QK && q.len() == QK);
    let a = _mm512_loadu_ps(chunk.as_ptr());
    let b = _mm512_loadu_ps(chunk.as_ptr().add(16));
    let amax = _mm512_reduce_max_ps(max_abs(max_abs(_mm512_setzero_ps(), a), b));
    let dd = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let idv = _mm512_set1_ps(id);
    let qa = nearest_int(_mm512_mul_ps(a, idv));
    let qb = nearest_int(_mm512_mul_ps(b, idv));
    _mm_storeu_si128(q.as_mut_ptr() as *mut __m128i, _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128(q.as_mut_ptr().add(16) as *mut __m128i, _mm512_cvtepi32_epi8(qb));
    (dd, _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb)))
}

/// The lane steps the AVX-512 activation quantizers share with their scalar definitions.
#[cfg(target_arch = "x86_64")]
pub(crate) mod quant_avx512 {
    use std::arch::x86_64::*;

    /// `m.max(|v|)` per lane with `f32::max`'s NaN rule: `vmaxps` returns its second operand
    /// when either is NaN, so a NaN `|v|` leaves `m` as the scalar fold leaves it.
    #[inline(always)]
    pub(crate) unsafe fn max_abs(m: __m512, v: __m512) -> __m512 {
        _mm512_max_ps(_mm512_abs_ps(v), m)
    }

    /// [`super::nearest_int`] per lane, bit for bit for every input (the 1.5 · 2^23 trick;
    /// `vcvtps2dq` would give `i32::MIN` where the scalar gives -2^22 for an infinite or NaN
    /// product).
    #[inline(always)]
    pub(crate) unsafe fn nearest_int(v: __m512) -> __m512i {
        let t = _mm512_castps_si512(_mm512_add_ps(v, _mm512_set1_ps(12_582_912.0)));
        _mm512_sub_epi32(
            _mm512_and_si512(t, _mm512_set1_epi32(0x007f_ffff)),
            _mm512_set1_epi32(0x0040_0000),
        )
    }
}

/// The activation quantizations on AVX2 (CPUs without AVX-512): the same bytes, scales and sums
/// as the scalar definitions, 8 lanes at a time. On the 2-core AVX2-only VMs the scalar loops
/// were serial time of every forward: each activation row of each projection is quantized on
/// the thread that then waits for the kernel pool.
#[cfg(target_arch = "x86_64")]
pub(crate) mod quant_avx2 {
    use super::QK;
    use std::arch::x86_64::*;

    /// `|v|` per lane (the sign bit cleared).
    #[inline(always)]
    pub(crate) unsafe fn abs(v: __m256) -> __m256 {
        _mm256_andnot_ps(_mm256_set1_ps(-0.0), v)
    }

    /// `m.max(|v|)` per lane with `f32::max`'s NaN rule: `maxps` returns its second operand when
    /// either is NaN, so a NaN `|v|` leaves `m` as the scalar fold leaves it.
    #[inline(always)]
    pub(crate) unsafe fn max_abs(m: __m256, v: __m256) -> __m256 {
        _mm256_max_ps(abs(v), m)
    }

    /// The largest lane of `m` (no NaN lanes: [`max_abs`] never makes one). Exact in any order.
    #[inline(always)]
    pub(crate) unsafe fn hmax(m: __m256) -> f32 {
        let h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        let h = _mm_max_ss(h, _mm_shuffle_ps::<1>(h, h));
        _mm_cvtss_f32(h)
    }

    /// The sum of the 8 i32 lanes (exact: integers, any order).
    #[inline(always)]
    pub(crate) unsafe fn hsum_i32(v: __m256i) -> i32 {
        let h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let h = _mm_add_epi32(h, _mm_unpackhi_epi64(h, h));
        let h = _mm_add_epi32(h, _mm_shuffle_epi32::<1>(h));
        _mm_cvtsi128_si32(h)
    }

    /// [`super::nearest_int`] per lane, bit for bit for every input (the 1.5 · 2^23 trick, not
    /// `vcvtps2dq`, which would give `i32::MIN` where the scalar gives -2^22 for an infinite or
    /// NaN product: a block whose largest magnitude is below 127 / `f32::MAX`).
    #[inline(always)]
    pub(crate) unsafe fn nearest_int(v: __m256) -> __m256i {
        let t = _mm256_castps_si256(_mm256_add_ps(v, _mm256_set1_ps(12_582_912.0)));
        _mm256_sub_epi32(
            _mm256_and_si256(t, _mm256_set1_epi32(0x007f_ffff)),
            _mm256_set1_epi32(0x0040_0000),
        )
    }

    /// 32 quants in four registers of 8 i32 lanes stored as 32 bytes in index order at `q`,
    /// each the low byte of its lane (`as i8`, as the scalar definitions narrow).
    #[inline(always)]
    pub(crate) unsafe fn store_bytes(q: *mut i8, v: [__m256i; 4]) {
        // Byte 0 of each dword to the low dword of each 128-bit half, then the halves' dwords
        // into index order.
        let low = _mm256_setr_epi8(
            0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
            -1, -1, -1, -1,
        );
        let [a, b, c, d] = v.map(|x| _mm256_shuffle_epi8(x, low));
        // a: [a0-3 . . . | a4-7 . . .]; combine to [a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7].
        let ab = _mm256_unpacklo_epi32(a, b);
        let cd = _mm256_unpacklo_epi32(c, d);
        let bytes = _mm256_unpacklo_epi64(ab, cd);
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        _mm256_storeu_si256(q as *mut __m256i, _mm256_permutevar8x32_epi32(bytes, order));
    }

    /// [`super::quantize_block`] in four 8-lane registers: `max` of the absolute values is exact
    /// in any order, [`nearest_int`] is the scalar's rounding lane by lane, and the quants narrow
    /// to their low byte as the scalar's `as i8` does: the same bytes and sum for every input.
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn quantize_block(chunk: &[f32], q: &mut [i8]) -> (f32, i32) {
        assert!(chunk.len() == QK && q.len() == QK);
        let v: [__m256; 4] = std::array::from_fn(|t| _mm256_loadu_ps(chunk.as_ptr().add(8 * t)));
        let m = v.iter().fold(_mm256_setzero_ps(), |m, &r| max_abs(m, r));
        let amax = hmax(m);
        let dd = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let idv = _mm256_set1_ps(id);
        let qi: [__m256i; 4] = std::array::from_fn(|t| nearest_int(_mm256_mul_ps(v[t], idv)));
        store_bytes(q.as_mut_ptr(), qi);
        let sum = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
        (dd, hsum_i32(sum))
    }
}

/// [`quantize_row`] of each `k`-wide row of `x`.
pub fn quantize_rows(x: &[f32], k: usize) -> Vec<QuantRow> {
    x.chunks_exact(k).map(quantize_row).collect()
}

/// Round half to even for |v| < 2^22, as ggml's `nearest_int` (the 1.5 * 2^23 trick) and
/// `_mm256_round_ps(_MM_ROUND_NEAREST)` do.
#[inline]
pub(crate) fn nearest_int(v: f32) -> i32 {
    let t = v + 12_582_912.0;
    (t.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// A weight matrix `[n, k]` in one of the [`QKind`] block formats, in owned memory, interleaved
/// by [`GROUP`] rows (module docs). Rows past `n` in the last group are zero.
#[derive(Debug, Clone)]
pub struct QWeight {
    kind: QKind,
    n: usize,
    k: usize,
    /// Blocks per row, `k / 32`.
    nb: usize,
    /// Groups of [`GROUP`] rows, `ceil(n / 16)`.
    groups: usize,
    /// Scales `d` (f16 bits, as stored), `[group][block][GROUP]`.
    d: Vec<u16>,
    /// Minimums `m` of the `_1` types (f16 bits), `[group][block][GROUP]`; else empty.
    m: Vec<u16>,
    /// Quants, `[group][block][dword][GROUP][4]`: 16 bytes of nibbles per row and block (4/5-bit
    /// types: byte `p` holds value `p` in its low nibble and `p + 16` in its high one) or 32
    /// signed bytes (Q8_0).
    qs: Vec<u8>,
    /// The fifth bits of the 5-bit types (bit `t` of a word: value `t`), `[group][block][GROUP]`;
    /// else empty.
    qh: Vec<u32>,
}

impl QWeight {
    /// An all-zero `[n, k]` weight of `kind`.
    fn zeros(kind: QKind, n: usize, k: usize) -> Self {
        let nb = k / QK;
        let groups = n.div_ceil(GROUP);
        let slots = groups * nb * GROUP;
        Self {
            kind,
            n,
            k,
            nb,
            groups,
            d: vec![0; slots],
            m: if kind.has_min() { vec![0; slots] } else { Vec::new() },
            qs: vec![0; slots * kind.qs_bytes()],
            qh: if kind.has_qh() { vec![0; slots] } else { Vec::new() },
        }
    }

    /// Index of (row `j`, block `b`) among the per-row slots (`d`, `m`, `qh`).
    #[inline]
    fn slot(&self, j: usize, b: usize) -> usize {
        ((j / GROUP) * self.nb + b) * GROUP + j % GROUP
    }

    /// Offset in `qs` of quant byte `p` of (row `j`, block `b`).
    #[inline]
    fn qs_at(&self, j: usize, b: usize, p: usize) -> usize {
        let ql = self.kind.qs_bytes();
        ((j / GROUP) * self.nb + b) * GROUP * ql + (p / 4) * GROUP * 4 + (j % GROUP) * 4 + p % 4
    }

    /// Store one ggml block (its bytes as in the file: `d`, [`m`], [`qh`], quants) at (row `j`,
    /// block `b`).
    fn put_block(&mut self, j: usize, b: usize, blk: &[u8]) {
        let s = self.slot(j, b);
        self.d[s] = u16::from_le_bytes([blk[0], blk[1]]);
        let mut at = 2;
        if self.kind.has_min() {
            self.m[s] = u16::from_le_bytes([blk[2], blk[3]]);
            at = 4;
        }
        if self.kind.has_qh() {
            self.qh[s] = u32::from_le_bytes([blk[at], blk[at + 1], blk[at + 2], blk[at + 3]]);
            at += 4;
        }
        for p in 0..self.kind.qs_bytes() {
            let o = self.qs_at(j, b, p);
            self.qs[o] = blk[at + p];
        }
    }

    /// The ggml block at (row `j`, block `b`), as [`put_block`](Self::put_block) takes it.
    fn get_block(&self, j: usize, b: usize) -> Vec<u8> {
        let s = self.slot(j, b);
        let mut blk = Vec::with_capacity(self.kind.block_bytes());
        blk.extend_from_slice(&self.d[s].to_le_bytes());
        if self.kind.has_min() {
            blk.extend_from_slice(&self.m[s].to_le_bytes());
        }
        if self.kind.has_qh() {
            blk.extend_from_slice(&self.qh[s].to_le_bytes());
        }
        for p in 0..self.kind.qs_bytes() {
            blk.push(self.qs[self.qs_at(j, b, p)]);
        }
        blk
    }

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
        let nb = k / QK;
        let bb = kind.block_bytes();
        if data.len() != n * nb * bb {
            candle_core::bail!("quantized tensor holds {} bytes, expected {}", data.len(), n * nb * bb);
        }
        let mut w = Self::zeros(kind, n, k);
        for (i, blk) in data.chunks_exact(bb).enumerate() {
            w.put_block(i / nb, i % nb, blk);
        }
        Ok(Some(w))
    }

    pub fn kind(&self) -> QKind {
        self.kind
    }

    /// The weight rows `ids`, in that order, as a new `[ids.len(), k]` weight (the blocks copied
    /// unchanged, so each output is bitwise what the full product gives at that row). Panics if
    /// an id is not below `n`.
    pub fn select_rows(&self, ids: &[u32]) -> Self {
        let mut w = Self::zeros(self.kind, ids.len(), self.k);
        for (r, &j) in ids.iter().enumerate() {
            assert!((j as usize) < self.n, "select_rows: row {j} of {}", self.n);
            for b in 0..self.nb {
                w.put_block(r, b, &self.get_block(j as usize, b));
            }
        }
        w
    }

    /// `(n, k)`: output features, input features.
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// The 32 signed values of (row `j`, block `b`) (value index = position in the block).
    fn block_values(&self, j: usize, b: usize) -> [i32; QK] {
        let mut v = [0i32; QK];
        let byte = |p: usize| self.qs[self.qs_at(j, b, p)];
        match self.kind {
            QKind::Q8_0 => {
                for (p, x) in v.iter_mut().enumerate() {
                    *x = byte(p) as i8 as i32;
                }
            }
            kind => {
                let qh = if kind.has_qh() { self.qh[self.slot(j, b)] } else { 0 };
                for p in 0..16 {
                    let q = byte(p);
                    let h0 = ((qh >> p) & 1) as i32;
                    let h1 = ((qh >> (p + 16)) & 1) as i32;
                    v[p] = ((q & 0x0F) as i32 | (h0 << 4)) - kind.bias();
                    v[p + 16] = ((q >> 4) as i32 | (h1 << 4)) - kind.bias();
                }
            }
        }
        v
    }

    /// The definition of one output element (module docs): weight row `j` against the quantized
    /// activation row `x`. Every path returns these bits.
    pub fn dot_portable(&self, j: usize, x: &QuantRow) -> f32 {
        let mut acc = 0f32;
        for b in 0..self.nb {
            let v = self.block_values(j, b);
            let isum: i32 = v
                .iter()
                .zip(&x.qs[b * QK..(b + 1) * QK])
                .map(|(&w, &q)| w * q as i32)
                .sum();
            let s = self.slot(j, b);
            acc = (isum as f32).mul_add(f16::from_bits(self.d[s]).to_f32() * x.d[b], acc);
            if self.kind.has_min() {
                acc = f16::from_bits(self.m[s]).to_f32().mul_add(x.s[b], acc);
            }
        }
        acc
    }

    /// `x`: `[m, k]` row-major f32 → `[m, n]` row-major f32. Row `i` of the result is bitwise
    /// the same whatever `m` is, and whichever [`KernelPath`](super::KernelPath) runs.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        self.matmul_on(x, m, super::kernel_path())
    }

    /// [`matmul`](Self::matmul) on the given path (falling back to what the CPU supports).
    pub(crate) fn matmul_on(&self, x: &[f32], m: usize, path: super::KernelPath) -> Vec<f32> {
        super::run_jobs(&[self.job_on(x, m, path)]).pop().unwrap_or_default()
    }

    /// The product with `x` (`[m, k]` row-major f32), ready to run with others in one parallel
    /// pass ([`super::run_jobs`]): the activation rows quantized here, on the calling thread.
    /// Panics if `x` is not `m * k` long.
    pub(crate) fn job(&self, x: &[f32], m: usize) -> super::TileJob<'_> {
        self.job_on(x, m, super::kernel_path())
    }

    /// [`job`](Self::job) with the activation rows already quantized ([`quantize_rows`]): the
    /// products of one input (a layer's q, k and v, or its gate and up) quantize it once. Panics
    /// if a row is not `k` wide.
    pub(crate) fn job_quantized<'a>(&'a self, rows: &'a [QuantRow]) -> super::TileJob<'a> {
        self.job_rows(std::borrow::Cow::Borrowed(rows), super::kernel_path())
    }

    fn job_on(&self, x: &[f32], m: usize, path: super::KernelPath) -> super::TileJob<'_> {
        assert_eq!(
            x.len(),
            m * self.k,
            "matmul: x has {} floats, expected {m} x {}",
            x.len(),
            self.k
        );
        self.job_rows(std::borrow::Cow::Owned(quantize_rows(x, self.k)), path)
    }

    fn job_rows<'a>(&'a self, rows: std::borrow::Cow<'a, [QuantRow]>, path: super::KernelPath) -> super::TileJob<'a> {
        let m = rows.len();
        assert!(
            rows.iter().all(|r| r.qs.len() == self.k),
            "matmul: activation rows of another width than {}",
            self.k
        );
        if GGML_LANES.with(|c| c.get()) && path != super::KernelPath::Portable {
            let groups = super::fixed_groups(m, 4);
            return super::TileJob::new(self.n, self.k, m, groups, 1, move |j, _, (_, i0, g), out| {
                ggml::dots(self, j, &rows[i0..i0 + g], out)
            });
        }
        #[cfg(target_arch = "x86_64")]
        {
            let vnni = super::has_avx512_vnni() && (!self.kind.has_qh() || has_avx512_vbmi());
            if path == super::KernelPath::Best && vnni {
                // Up to 16 rows in one group (a verify of up to 15 drafts, 16 streams): the
                // weights are unpacked once for all of them, where a second group would
                // unpack them again (about 4 rows' cost on the 0.5B). Larger products keep
                // groups of 8: the 16-row tile spills registers, which costs prefill ~14%.
                let groups = super::row_groups(m, if m <= VNNI_ROWS { VNNI_ROWS } else { VNNI_ROWS / 2 });
                let acts = Acts::new(self.kind, rows, groups.clone(), self.nb);
                let wtile = if m == 1 { 2 * GROUP } else { GROUP };
                return super::TileJob::new(self.n, self.k, m, groups, wtile, move |j0, nw, (gi, _, _), out| {
                    // SAFETY: AVX-512 F/BW/VL/VNNI (and VBMI for the 5-bit kinds), AVX2, FMA and
                    // F16C were detected at run time; the tile is checked inside.
                    unsafe { vnni_impl::tile_dispatch(self, &acts, j0, nw, gi, out) }
                });
            }
            if path != super::KernelPath::Portable && has_avx2() {
                let groups = super::row_groups(m, AVX2_ROWS);
                let acts = Acts::new(self.kind, rows, groups.clone(), self.nb);
                return super::TileJob::new(self.n, self.k, m, groups, GROUP, move |j0, nw, (gi, _, _), out| {
                    // SAFETY: AVX2, FMA and F16C were detected at run time; the tile is checked
                    // inside.
                    unsafe { avx2_impl::tile_dispatch(self, &acts, j0, nw, gi, out) }
                });
            }
        }
        let _ = path;
        let ggml = GGML_LANES.with(|c| c.get());
        let groups = super::fixed_groups(m, 4);
        super::TileJob::new(self.n, self.k, m, groups, 1, move |j, _, (_, i0, g), out| {
            for (o, x) in out.iter_mut().zip(&rows[i0..i0 + g]) {
                *o = if ggml {
                    ggml::dot_portable(self, j, x)
                } else {
                    self.dot_portable(j, x)
                };
            }
        })
    }

    /// Checks shared by the SIMD tiles: the tile starts a group, fits the matrix and `out`, and
    /// the activation rows are as long as the weights.
    fn check_tile(&self, a: &Acts, j0: usize, nw: usize, gi: usize, max_rows: usize, out: &[f32]) {
        let (i0, g) = a.groups[gi];
        assert!(
            j0.is_multiple_of(GROUP)
                && nw >= 1
                && nw <= max_rows
                && j0 + nw <= self.n
                && a.nb == self.nb
                && out.len() >= nw * g,
            "tile out of range"
        );
        for x in &a.rows[i0..i0 + g] {
            assert!(
                x.qs.len() >= self.nb * QK && x.d.len() >= self.nb && x.s.len() >= self.nb,
                "activation row shorter than the weights"
            );
        }
    }
}

/// Largest activation row group of the VNNI tile kernel (used whole only when it holds every
/// row of the product; see `job_rows`).
pub const VNNI_ROWS: usize = 16;

/// Largest activation row group of the AVX2 tile kernel.
const AVX2_ROWS: usize = 8;

/// Activation rows prepared for the tile kernels: the quantized rows, their groups, and per row
/// and block the exact integer correction of the unsigned weight encoding (`-bias * sum(q_x)`).
struct Acts<'a> {
    rows: std::borrow::Cow<'a, [QuantRow]>,
    groups: Vec<(usize, usize)>,
    nb: usize,
    /// `[row][block]` (empty for the `_1` kinds, whose weights are unsigned already).
    corr: Vec<i32>,
}

impl<'a> Acts<'a> {
    fn new(kind: QKind, rows: std::borrow::Cow<'a, [QuantRow]>, groups: Vec<(usize, usize)>, nb: usize) -> Self {
        let bias = kind.bias();
        let corr = if bias == 0 {
            Vec::new()
        } else {
            rows.iter()
                .flat_map(|x| {
                    x.qs.chunks_exact(QK)
                        .map(|q| -bias * q.iter().map(|&v| v as i32).sum::<i32>())
                })
                .collect()
        };
        Self { rows, groups, nb, corr }
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

/// AVX-512 VBMI available at run time (`vpmultishiftqb`, the 5-bit kinds' high bits in the VNNI
/// kernel).
fn has_avx512_vbmi() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512vbmi")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// ggml's `hsum_float_8`: ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)) (the K-quant kernels' final sum).
#[inline]
pub(crate) fn hsum8(a: &[f32; 8]) -> f32 {
    let r = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    let r0 = r[0] + r[2];
    let r1 = r[1] + r[3];
    r0 + r1
}

thread_local! {
    static GGML_LANES: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Run `f` with the products of this module in ggml's own arithmetic (see [`ggml`]) on this
/// thread: the reference comparison with llama.cpp (`Engine::logits_as_llamacpp`) only. Serving
/// never uses it; it is slower (row kernels, no VNNI tile) and gives other bits.
pub fn with_ggml_arithmetic<R>(on: bool, f: impl FnOnce() -> R) -> R {
    super::with_thread_local(&GGML_LANES, on, f)
}

pub mod ggml {
    //! ggml's x86 dot products (`ggml_vec_dot_q*_q8_*` in `ggml-cpu/arch/x86/quants.c`), the
    //! arithmetic llama.cpp multiplies these block types with: per block, eight exact integer
    //! partial sums (lane `l` holds the products of values `4l .. 4l + 3`), converted to f32 and
    //! accumulated lane-wise with one FMA by `d_w * d_x`; after the last block the lanes are
    //! summed in ggml's `hsum_float_8` order, and for the `_1` types the `m_w * s_x` terms
    //! (accumulated separately by FMA) are added. Reproduced for the reference comparison only
    //! ([`with_ggml_arithmetic`](super::with_ggml_arithmetic)).

    use super::*;

    /// One output in ggml's arithmetic, portable.
    pub fn dot_portable(w: &QWeight, j: usize, x: &QuantRow) -> f32 {
        let mut acc = [0f32; 8];
        let mut summs = 0f32;
        for b in 0..w.nb {
            let v = w.block_values(j, b);
            let qx = &x.qs[b * QK..(b + 1) * QK];
            let s = w.slot(j, b);
            let d = f16::from_bits(w.d[s]).to_f32() * x.d[b];
            if w.kind.has_min() {
                summs = f16::from_bits(w.m[s]).to_f32().mul_add(x.s[b], summs);
            }
            for (l, a) in acc.iter_mut().enumerate() {
                let s: i32 = (0..4).map(|t| v[4 * l + t] * qx[4 * l + t] as i32).sum();
                *a = (s as f32).mul_add(d, *a);
            }
        }
        hsum8(&acc) + summs
    }

    /// Weight row `j` against up to four activation rows (`out[r]` for `xs[r]`), on AVX2 where
    /// the CPU has it: bitwise [`dot_portable`].
    pub(super) fn dots(w: &QWeight, j: usize, xs: &[QuantRow], out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            // SAFETY: AVX2, FMA and F16C were detected at run time.
            unsafe { avx2::dots(w, j, xs, out) };
            return;
        }
        for (o, x) in out.iter_mut().zip(xs) {
            *o = dot_portable(w, j, x);
        }
    }

    #[cfg(target_arch = "x86_64")]
    mod avx2 {
        use super::*;
        use std::arch::x86_64::*;

        /// The 32 values of (row `j`, block `b`) as signed bytes (value index = byte index).
        #[inline]
        #[target_feature(enable = "avx2")]
        unsafe fn load_block(w: &QWeight, j: usize, b: usize) -> __m256i {
            let word = |p: usize| (w.qs.as_ptr().add(w.qs_at(j, b, p)) as *const i32).read_unaligned();
            if w.kind == QKind::Q8_0 {
                return _mm256_setr_epi32(
                    word(0),
                    word(4),
                    word(8),
                    word(12),
                    word(16),
                    word(20),
                    word(24),
                    word(28),
                );
            }
            let raw = _mm_setr_epi32(word(0), word(4), word(8), word(12));
            let nib = _mm256_and_si256(
                _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(raw), _mm_srli_epi16::<4>(raw)),
                _mm256_set1_epi8(0x0F),
            );
            let v = if w.kind.has_qh() {
                let qh = w.qh[w.slot(j, b)];
                let shuf = _mm256_setr_epi64x(0, 0x0101_0101_0101_0101, 0x0202_0202_0202_0202, 0x0303_0303_0303_0303);
                let r = _mm256_shuffle_epi8(_mm256_set1_epi32(qh as i32), shuf);
                let r = _mm256_or_si256(r, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe_u64 as i64));
                let on = _mm256_cmpeq_epi8(r, _mm256_set1_epi64x(-1));
                _mm256_or_si256(nib, _mm256_and_si256(on, _mm256_set1_epi8(0x10)))
            } else {
                nib
            };
            _mm256_sub_epi8(v, _mm256_set1_epi8(w.kind.bias() as i8))
        }

        /// ggml's lane sums of `a` times `b` (both signed, |a| ≤ 128), as 8 × f32 (exact).
        #[inline]
        #[target_feature(enable = "avx2")]
        unsafe fn lanes(a: __m256i, b: __m256i) -> __m256 {
            let dot16 = _mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
            _mm256_cvtepi32_ps(_mm256_madd_epi16(dot16, _mm256_set1_epi16(1)))
        }

        #[target_feature(enable = "avx2,fma,f16c")]
        pub(super) unsafe fn dots(w: &QWeight, j: usize, xs: &[QuantRow], out: &mut [f32]) {
            let h2f = |h: u16| _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)));
            let mut acc = [_mm256_setzero_ps(); 4];
            let mut summs = [0f32; 4];
            let n = xs.len().min(4);
            for b in 0..w.nb {
                let qw = load_block(w, j, b);
                let s = w.slot(j, b);
                let dw = h2f(w.d[s]);
                let mw = if w.kind.has_min() { h2f(w.m[s]) } else { 0.0 };
                for r in 0..n {
                    let x = &xs[r];
                    let qx = _mm256_loadu_si256(x.qs.as_ptr().add(b * QK) as *const __m256i);
                    if w.kind.has_min() {
                        summs[r] = mw.mul_add(x.s[b], summs[r]);
                    }
                    acc[r] = _mm256_fmadd_ps(lanes(qw, qx), _mm256_set1_ps(dw * x.d[b]), acc[r]);
                }
            }
            for r in 0..n {
                let mut l = [0f32; 8];
                _mm256_storeu_ps(l.as_mut_ptr(), acc[r]);
                out[r] = hsum8(&l) + summs[r];
            }
        }
    }
}

/// [`QKind`] as a const generic parameter of the SIMD kernels.
#[cfg(target_arch = "x86_64")]
mod kinds {
    pub const Q4_0: u8 = 0;
    pub const Q4_1: u8 = 1;
    pub const Q5_0: u8 = 2;
    pub const Q5_1: u8 = 3;
    pub const Q8_0: u8 = 4;

    pub fn of(k: super::QKind) -> u8 {
        match k {
            super::QKind::Q4_0 => Q4_0,
            super::QKind::Q4_1 => Q4_1,
            super::QKind::Q5_0 => Q5_0,
            super::QKind::Q5_1 => Q5_1,
            super::QKind::Q8_0 => Q8_0,
        }
    }
}

/// Prefetching of a group's block stream, shared by the AVX2 and VNNI tiles.
#[cfg(target_arch = "x86_64")]
mod prefetch {
    use super::kinds::*;
    use super::*;
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};

    /// Blocks ahead in each group's stream that a tile prefetches (past the group's last block,
    /// into the group the next tile reads in its place). 4, 8 and 16 measured alike on the 2-core
    /// Zen 5 VM (`speed_streamed`, whole-model decode); whole tiles ahead (two tiles: 30-60 KB for
    /// the Q8_0 LM heads) measured 20% slower than the earlier row layout on a Q8_0 LM head.
    pub(crate) const PREFETCH_BLOCKS: usize = 8;

    /// Prefetch block `b` of group `g` (quants, scales, minimums, high bits). A prefetch past the
    /// end of the matrix is harmless: it never faults.
    #[inline(always)]
    pub(crate) unsafe fn prefetch_group<const K: u8>(w: &QWeight, g: usize, b: usize) {
        let qb = if K == Q8_0 { 32 } else { 16 };
        let base = g * w.nb + b;
        let pq = w.qs.as_ptr().wrapping_add(base * GROUP * qb);
        for l in (0..GROUP * qb).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(pq.wrapping_add(l) as *const i8);
        }
        _mm_prefetch::<_MM_HINT_T0>(w.d.as_ptr().wrapping_add(base * GROUP) as *const i8);
        if K == Q4_1 || K == Q5_1 {
            _mm_prefetch::<_MM_HINT_T0>(w.m.as_ptr().wrapping_add(base * GROUP) as *const i8);
        }
        if K == Q5_0 || K == Q5_1 {
            _mm_prefetch::<_MM_HINT_T0>(w.qh.as_ptr().wrapping_add(base * GROUP) as *const i8);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2_impl {
    //! The AVX2 tile: 8 weight rows per 256-bit register (half a group) times up to
    //! [`AVX2_ROWS`] activation rows. Block sums by `maddubs` + `madd` (exact: the unsigned
    //! 4/5-bit values times a Q8 byte never saturate a pair, and Q8_0 goes through the `sign`
    //! trick, |w| ≤ 128), then the float steps of [`QWeight::dot_portable`] per lane.

    use super::kinds::*;
    use super::prefetch::{prefetch_group, PREFETCH_BLOCKS};
    use super::*;
    use std::arch::x86_64::*;

    /// For each 32-bit lane of `qh`, the bits `shift .. shift + 4` as bit 4 of the lane's four
    /// bytes (0x10 or 0).
    #[inline(always)]
    unsafe fn high_bits(qh: __m256i, shift: i32) -> __m256i {
        let v = _mm256_srl_epi32(qh, _mm_cvtsi32_si128(shift));
        let v = _mm256_shuffle_epi8(
            v,
            _mm256_setr_epi8(
                0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12,
            ),
        );
        let sel = _mm256_set1_epi32(0x0804_0201);
        let on = _mm256_cmpeq_epi8(_mm256_and_si256(v, sel), sel);
        _mm256_and_si256(on, _mm256_set1_epi8(0x10))
    }

    /// One tile: weight rows `j0 .. j0 + nw` (one group) × the `R` activation rows from `i0`,
    /// `out[r * nw + w]`. Per block, each half's weights are unpacked once for all `R` rows; with
    /// `pf` the tile prefetches [`PREFETCH_BLOCKS`] ahead in the group's stream, running on into
    /// the next group (the next tile of the chunk).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const K: u8, const R: usize>(
        w: &QWeight,
        a: &Acts,
        j0: usize,
        nw: usize,
        i0: usize,
        pf: bool,
        out: &mut [f32],
    ) {
        let nb = w.nb;
        let has_min = K == Q4_1 || K == Q5_1;
        let biased = K == Q4_0 || K == Q5_0;
        let qb = if K == Q8_0 { 32 } else { 16 };
        let g = j0 / GROUP;
        let ones = _mm256_set1_epi16(1);
        let nibble = _mm256_set1_epi8(0x0F);
        let halves = if nw > 8 { 2 } else { 1 };
        let mut acc = [[_mm256_setzero_ps(); R]; 2];
        for b in 0..nb {
            if pf {
                let pb = b + PREFETCH_BLOCKS;
                if pb < nb {
                    prefetch_group::<K>(w, g, pb);
                } else {
                    prefetch_group::<K>(w, g + 1, pb - nb);
                }
            }
            let base = g * nb + b;
            for (h, acc) in acc.iter_mut().enumerate().take(halves) {
                let pq = w.qs.as_ptr().add(base * GROUP * qb + 32 * h);
                let mut wv = [_mm256_setzero_si256(); 8];
                // Q8_0: the weights' magnitudes, once for all the activation rows (their signs
                // go onto the activations, `sign(x, w)`, per row).
                let mut wabs = [_mm256_setzero_si256(); 8];
                if K == Q8_0 {
                    for (t, (v, a)) in wv.iter_mut().zip(wabs.iter_mut()).enumerate() {
                        *v = _mm256_loadu_si256(pq.add(t * 64) as *const __m256i);
                        *a = _mm256_abs_epi8(*v);
                    }
                } else {
                    for t in 0..4 {
                        let raw = _mm256_loadu_si256(pq.add(t * 64) as *const __m256i);
                        wv[t] = _mm256_and_si256(raw, nibble);
                        wv[4 + t] = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), nibble);
                    }
                    if K == Q5_0 || K == Q5_1 {
                        let qh = _mm256_loadu_si256(w.qh.as_ptr().add(base * GROUP + 8 * h) as *const __m256i);
                        for t in 0..4 {
                            wv[t] = _mm256_or_si256(wv[t], high_bits(qh, 4 * t as i32));
                            wv[4 + t] = _mm256_or_si256(wv[4 + t], high_bits(qh, 16 + 4 * t as i32));
                        }
                    }
                }
                let dw = _mm256_cvtph_ps(_mm_loadu_si128(w.d.as_ptr().add(base * GROUP + 8 * h) as *const __m128i));
                let mw = if has_min {
                    _mm256_cvtph_ps(_mm_loadu_si128(w.m.as_ptr().add(base * GROUP + 8 * h) as *const __m128i))
                } else {
                    _mm256_setzero_ps()
                };
                for (r, acc) in acc.iter_mut().enumerate() {
                    let x = &a.rows[i0 + r];
                    let xq = x.qs.as_ptr().add(b * QK) as *const i32;
                    let mut isum = if biased {
                        _mm256_set1_epi32(*a.corr.get_unchecked((i0 + r) * nb + b))
                    } else {
                        _mm256_setzero_si256()
                    };
                    if K == Q8_0 {
                        for (t, (&v, &va)) in wv.iter().zip(&wabs).enumerate() {
                            let xb = _mm256_set1_epi32(xq.add(t).read_unaligned());
                            let p = _mm256_maddubs_epi16(va, _mm256_sign_epi8(xb, v));
                            isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, ones));
                        }
                    } else {
                        // The 16-bit pair sums of `maddubs` are added in 16 bits before one
                        // `madd` widens them: a pair is at most 2 · 31 · 127 = 7,874 in magnitude
                        // (activation quants are within ±127), so four of them, or eight 4-bit
                        // pairs (2 · 15 · 127 = 3,810 each), stay below 2^15 and the sum is exact.
                        let span = if K == Q5_0 || K == Q5_1 { 4 } else { 8 };
                        for half in wv.chunks_exact(span).enumerate() {
                            let (c, vs) = half;
                            let mut s16 = _mm256_setzero_si256();
                            for (u, &v) in vs.iter().enumerate() {
                                let xb = _mm256_set1_epi32(xq.add(c * span + u).read_unaligned());
                                s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(v, xb));
                            }
                            isum = _mm256_add_epi32(isum, _mm256_madd_epi16(s16, ones));
                        }
                    }
                    let dd = _mm256_mul_ps(dw, _mm256_set1_ps(*x.d.get_unchecked(b)));
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), dd, *acc);
                    if has_min {
                        *acc = _mm256_fmadd_ps(mw, _mm256_set1_ps(*x.s.get_unchecked(b)), *acc);
                    }
                }
            }
        }
        for r in 0..R {
            let mut v = [0f32; GROUP];
            _mm256_storeu_ps(v.as_mut_ptr(), acc[0][r]);
            _mm256_storeu_ps(v.as_mut_ptr().add(8), acc[1][r]);
            out[r * nw..(r + 1) * nw].copy_from_slice(&v[..nw]);
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile_rows<const K: u8>(w: &QWeight, a: &Acts, j0: usize, nw: usize, gi: usize, out: &mut [f32]) {
        let (i0, g) = a.groups[gi];
        let pf = gi == 0;
        by_rows!(g, |R| tile::<K, R>(w, a, j0, nw, i0, pf, out))
    }

    /// One tile of the product: weight rows `j0 .. j0 + nw` (`j0` a multiple of [`GROUP`], `nw`
    /// ≤ 16), the rows of group `gi`, `out[r * nw + w]`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn tile_dispatch(w: &QWeight, a: &Acts, j0: usize, nw: usize, gi: usize, out: &mut [f32]) {
        w.check_tile(a, j0, nw, gi, GROUP, out);
        match kinds::of(w.kind) {
            Q4_0 => tile_rows::<Q4_0>(w, a, j0, nw, gi, out),
            Q4_1 => tile_rows::<Q4_1>(w, a, j0, nw, gi, out),
            Q5_0 => tile_rows::<Q5_0>(w, a, j0, nw, gi, out),
            Q5_1 => tile_rows::<Q5_1>(w, a, j0, nw, gi, out),
            _ => tile_rows::<Q8_0>(w, a, j0, nw, gi, out),
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod vnni_impl {
    //! The AVX-512 VNNI tile: one group of 16 weight rows per 512-bit register (lane = weight
    //! row) times 1..=8 activation rows, or two groups times one row (a decode step). Per (group,
    //! activation row, block) the 16 block sums come from eight `vpdpbusd` (each one dword of
    //! the 16 rows against the matching 4 activation bytes broadcast), started from the exact
    //! correction of the unsigned encoding, then one convert, one `d_w · d_x` multiply and one or
    //! two FMAs for all 16 rows: the float steps of [`QWeight::dot_portable`], lane for lane.

    use super::kinds::*;
    use super::prefetch::{prefetch_group, PREFETCH_BLOCKS};
    use super::*;
    use std::arch::x86_64::*;

    /// f16 bits `a`, `b` → `[f32(a) × 8, f32(b) × 8]` (F16C conversion: exact).
    #[inline(always)]
    pub(crate) unsafe fn f16_pair(a: u16, b: u16) -> __m512 {
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128((a as u32 | (b as u32) << 16) as i32));
        let idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v))
    }

    /// ggml's `hsum_float_8`, `((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7))`, of each 256-bit half,
    /// as the two values (low half, high half): the same additions in the same order, four lanes
    /// at a time (the K-quant kernels' final sum).
    #[inline(always)]
    pub(crate) unsafe fn hsum_halves(v: __m512) -> (f32, f32) {
        // Lane i (i < 4) of each half: a_i + a_{i+4}.
        let r = _mm512_add_ps(v, _mm512_shuffle_f32x4::<0b10_11_00_01>(v, v));
        // Lanes 0, 1: r0 + r2, r1 + r3.
        let t = _mm512_add_ps(r, _mm512_permute_ps::<0b01_00_11_10>(r));
        // Lane 0: (r0 + r2) + (r1 + r3).
        let u = _mm512_add_ps(t, _mm512_permute_ps::<0b10_11_00_01>(t));
        let mut l = [0f32; 16];
        _mm512_storeu_ps(l.as_mut_ptr(), u);
        (l[0], l[8])
    }

    /// `vpmultishiftqb` controls that bring the fifth bits of the 16 rows' values to bit 4 of the
    /// bytes of weight vector `t` (`t < 4`: the low nibbles of dword `t`, values `4t .. 4t + 3`;
    /// `t ≥ 4`: the high nibbles of dword `t - 4`, values `16 + 4(t - 4) ..`). A qword holds two
    /// rows' `qh` words; byte `e` of row `h` (0, 1) of the qword takes the 8 bits from
    /// `32h + value - 4` (mod 64), whose bit 4 is the value's fifth bit.
    const fn qh_ctrl(t: usize) -> [u8; 64] {
        let first = if t < 4 { 4 * t } else { 16 + 4 * (t - 4) };
        let mut c = [0u8; 64];
        let mut i = 0;
        while i < 64 {
            let (h, e) = ((i % 8) / 4, i % 4);
            c[i] = ((32 * h + first + e + 60) % 64) as u8;
            i += 1;
        }
        c
    }

    static QH_CTRL: [[u8; 64]; 8] = [
        qh_ctrl(0),
        qh_ctrl(1),
        qh_ctrl(2),
        qh_ctrl(3),
        qh_ctrl(4),
        qh_ctrl(5),
        qh_ctrl(6),
        qh_ctrl(7),
    ];

    /// One tile: the `G` groups from weight row `j0` (rows `j0 .. j0 + nw`; a group past the
    /// last is computed as the last and dropped) × the `R` activation rows from `i0`;
    /// `out[w * R + r]`. `ahead`: prefetch, and how many groups on the next tile's counterpart
    /// of each group is.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
    unsafe fn tile<const K: u8, const G: usize, const R: usize>(
        w: &QWeight,
        a: &Acts,
        j0: usize,
        nw: usize,
        i0: usize,
        ahead: Option<usize>,
        out: &mut [f32],
    ) {
        let nb = w.nb;
        let has_min = K == Q4_1 || K == Q5_1;
        let qb = if K == Q8_0 { 32 } else { 16 };
        let gs: [usize; G] = std::array::from_fn(|i| (j0 / GROUP + i).min(w.groups - 1));
        let yq: [*const i8; R] = std::array::from_fn(|r| a.rows[i0 + r].qs.as_ptr());
        let yd: [*const f32; R] = std::array::from_fn(|r| a.rows[i0 + r].d.as_ptr());
        let ys: [*const f32; R] = std::array::from_fn(|r| a.rows[i0 + r].s.as_ptr());
        let cq: [*const i32; R] = std::array::from_fn(|r| {
            if has_min {
                std::ptr::null()
            } else {
                a.corr.as_ptr().add((i0 + r) * nb)
            }
        });
        let nibble = _mm512_set1_epi8(0x0F);
        let pf = PREFETCH_BLOCKS;
        let mut acc = [[_mm512_setzero_ps(); R]; G];
        for b in 0..nb {
            if let Some(step) = ahead {
                let pb = b + pf;
                for &g in &gs {
                    if pb < nb {
                        prefetch_group::<K>(w, g, pb);
                    } else {
                        prefetch_group::<K>(w, g + step, pb - nb);
                    }
                }
            }
            for (gi, acc) in acc.iter_mut().enumerate() {
                let base = gs[gi] * nb + b;
                let pq = w.qs.as_ptr().add(base * GROUP * qb);
                let mut wv = [_mm512_setzero_si512(); 8];
                if K == Q8_0 {
                    for (t, v) in wv.iter_mut().enumerate() {
                        let raw = _mm512_loadu_si512(pq.add(64 * t) as *const __m512i);
                        *v = _mm512_xor_si512(raw, _mm512_set1_epi8(0x80u8 as i8));
                    }
                } else {
                    for t in 0..4 {
                        let raw = _mm512_loadu_si512(pq.add(64 * t) as *const __m512i);
                        wv[t] = _mm512_and_si512(raw, nibble);
                        wv[4 + t] = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), nibble);
                    }
                    if K == Q5_0 || K == Q5_1 {
                        let qh = _mm512_loadu_si512(w.qh.as_ptr().add(base * GROUP) as *const __m512i);
                        for (t, v) in wv.iter_mut().enumerate() {
                            let ctrl = _mm512_loadu_si512(QH_CTRL[t].as_ptr() as *const __m512i);
                            let hb = _mm512_multishift_epi64_epi8(ctrl, qh);
                            *v = _mm512_ternarylogic_epi32::<0xF8>(*v, hb, _mm512_set1_epi8(0x10));
                        }
                    }
                }
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(w.d.as_ptr().add(base * GROUP) as *const __m256i));
                let mw = if has_min {
                    _mm512_cvtph_ps(_mm256_loadu_si256(w.m.as_ptr().add(base * GROUP) as *const __m256i))
                } else {
                    _mm512_setzero_ps()
                };
                for (r, acc) in acc.iter_mut().enumerate() {
                    let xq = yq[r].add(b * QK) as *const i32;
                    let mut s0 = if has_min {
                        _mm512_setzero_si512()
                    } else {
                        _mm512_set1_epi32(*cq[r].add(b))
                    };
                    let mut s1 = _mm512_setzero_si512();
                    for t in (0..8).step_by(2) {
                        s0 = _mm512_dpbusd_epi32(s0, wv[t], _mm512_set1_epi32(xq.add(t).read_unaligned()));
                        s1 = _mm512_dpbusd_epi32(s1, wv[t + 1], _mm512_set1_epi32(xq.add(t + 1).read_unaligned()));
                    }
                    let isum = _mm512_add_epi32(s0, s1);
                    let dd = _mm512_mul_ps(dw, _mm512_set1_ps(*yd[r].add(b)));
                    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), dd, *acc);
                    if has_min {
                        *acc = _mm512_fmadd_ps(mw, _mm512_set1_ps(*ys[r].add(b)), *acc);
                    }
                }
            }
        }
        // Row-major `out[r * nw + t]` (`check_tile`: `out` holds `nw * R` values), each
        // register's lanes `t < nw` in one masked store.
        for (gi, acc) in acc.iter().enumerate() {
            let t0 = gi * GROUP;
            if t0 >= nw {
                break;
            }
            let mask = ((1u32 << (nw - t0).min(GROUP)) - 1) as __mmask16;
            for (r, acc) in acc.iter().enumerate() {
                _mm512_mask_storeu_ps(out.as_mut_ptr().add(r * nw + t0), mask, *acc);
            }
        }
    }

    /// [`tile`] for the kind and the group's row count.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
    unsafe fn tile_rows<const K: u8>(
        w: &QWeight,
        a: &Acts,
        j0: usize,
        nw: usize,
        gi: usize,
        ahead: Option<usize>,
        out: &mut [f32],
    ) {
        let (i0, g) = a.groups[gi];
        match g {
            1 => tile::<K, 2, 1>(w, a, j0, nw, i0, ahead, out),
            2 => tile::<K, 1, 2>(w, a, j0, nw, i0, ahead, out),
            3 => tile::<K, 1, 3>(w, a, j0, nw, i0, ahead, out),
            4 => tile::<K, 1, 4>(w, a, j0, nw, i0, ahead, out),
            5 => tile::<K, 1, 5>(w, a, j0, nw, i0, ahead, out),
            6 => tile::<K, 1, 6>(w, a, j0, nw, i0, ahead, out),
            7 => tile::<K, 1, 7>(w, a, j0, nw, i0, ahead, out),
            8 => tile::<K, 1, 8>(w, a, j0, nw, i0, ahead, out),
            9 => tile::<K, 1, 9>(w, a, j0, nw, i0, ahead, out),
            10 => tile::<K, 1, 10>(w, a, j0, nw, i0, ahead, out),
            11 => tile::<K, 1, 11>(w, a, j0, nw, i0, ahead, out),
            12 => tile::<K, 1, 12>(w, a, j0, nw, i0, ahead, out),
            13 => tile::<K, 1, 13>(w, a, j0, nw, i0, ahead, out),
            14 => tile::<K, 1, 14>(w, a, j0, nw, i0, ahead, out),
            15 => tile::<K, 1, 15>(w, a, j0, nw, i0, ahead, out),
            16 => tile::<K, 1, 16>(w, a, j0, nw, i0, ahead, out),
            _ => panic!("group of {g} rows"),
        }
    }

    /// One tile of the product (see [`QWeight::matmul`]): weight rows `j0 .. j0 + nw` (`j0` a
    /// multiple of [`GROUP`]; `nw` ≤ 32 for a one-row group, else ≤ 16), the rows of group `gi`,
    /// `out[r * nw + w]`. With one row group the tiles run through the chunk's weight rows in
    /// order, each prefetching [`PREFETCH_BLOCKS`] ahead in its groups' streams (running on into
    /// the next tile's); with several, each panel of 16 weight rows is read from memory by the
    /// first group's tile, which prefetches the same way into the next panel, and from cache by
    /// the others.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
    pub(super) unsafe fn tile_dispatch(w: &QWeight, a: &Acts, j0: usize, nw: usize, gi: usize, out: &mut [f32]) {
        let per = if a.groups[gi].1 == 1 { 2 } else { 1 };
        w.check_tile(a, j0, nw, gi, per * GROUP, out);
        let ahead = match (a.groups.len(), gi) {
            (1, _) => Some(per),
            (_, 0) => Some(1),
            _ => None,
        };
        match kinds::of(w.kind) {
            Q4_0 => tile_rows::<Q4_0>(w, a, j0, nw, gi, ahead, out),
            Q4_1 => tile_rows::<Q4_1>(w, a, j0, nw, gi, ahead, out),
            Q5_0 => tile_rows::<Q5_0>(w, a, j0, nw, gi, ahead, out),
            Q5_1 => tile_rows::<Q5_1>(w, a, j0, nw, gi, ahead, out),
            _ => tile_rows::<Q8_0>(w, a, j0, nw, gi, ahead, out),
        }
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

    /// The interleaved layout keeps every block: each one read back is the file's, and the
    /// values of a block are ggml's dequantization divided by its scale (and minimum).
    #[test]
    fn layout_round_trips_the_file_blocks() {
        for dt in KINDS {
            let (n, k) = (37, 96);
            let (q, deq) = weight(dt, n, k);
            let w = QWeight::from_qtensor(&q).unwrap().unwrap();
            let data = q.data().unwrap();
            let bb = w.kind.block_bytes();
            for (i, blk) in data.chunks_exact(bb).enumerate() {
                let (j, b) = (i / w.nb, i % w.nb);
                assert_eq!(w.get_block(j, b), blk, "{dt:?} row {j} block {b}");
                let v = w.block_values(j, b);
                let s = w.slot(j, b);
                let d = f16::from_bits(w.d[s]).to_f32();
                let m = if w.kind.has_min() {
                    f16::from_bits(w.m[s]).to_f32()
                } else {
                    0.0
                };
                for t in 0..QK {
                    let want = deq[j * k + b * QK + t];
                    assert!(
                        (d * v[t] as f32 + m - want).abs() <= 1e-6 * want.abs().max(1.0),
                        "{dt:?} value {t}"
                    );
                }
            }
        }
    }

    #[test]
    fn rows_are_batch_invariant() {
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
        }
    }

    /// A subset of rows gives each row's bits of the full product.
    #[test]
    fn selected_rows_are_the_full_products_rows() {
        let (n, k) = (70, 64);
        for dt in KINDS {
            let w = QWeight::from_qtensor(&weight(dt, n, k).0).unwrap().unwrap();
            let ids = [69u32, 0, 17, 16, 33, 5, 5, 40];
            let sub = w.select_rows(&ids);
            for m in [1usize, 3, 9] {
                let x = pseudo(m * k, 40 + m as u64);
                let full = w.matmul(&x, m);
                let part = sub.matmul(&x, m);
                for i in 0..m {
                    for (c, &j) in ids.iter().enumerate() {
                        assert_eq!(
                            part[i * ids.len() + c].to_bits(),
                            full[i * n + j as usize].to_bits(),
                            "{dt:?} m={m} row {i} id {j}"
                        );
                    }
                }
            }
        }
    }

    /// A weight matrix with random blocks, some blocks at the extremes of the encoding (all
    /// quants minimal / maximal, all high bits set), and random f16 scales and mins.
    fn raw_weight(kind: QKind, n: usize, k: usize, seed: u64) -> QWeight {
        let nb = k / QK;
        let mut st = seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1;
        let mut next = move || {
            st ^= st << 13;
            st ^= st >> 7;
            st ^= st << 17;
            st
        };
        let mut w = QWeight::zeros(kind, n, k);
        for blk in 0..n * nb {
            let mode = blk % 5;
            let scale = (next() % 2000) as f32 / 1000.0 * if next() % 2 == 0 { 1.0 } else { -1.0 };
            let mut bytes = f16::from_f32(scale * 0.01).to_bits().to_le_bytes().to_vec();
            if kind.has_min() {
                bytes.extend_from_slice(
                    &f16::from_f32((next() % 2000) as f32 / 1000.0 - 1.0)
                        .to_bits()
                        .to_le_bytes(),
                );
            }
            if kind.has_qh() {
                let qh: u32 = match mode {
                    0 => 0,
                    1 => u32::MAX,
                    _ => next() as u32,
                };
                bytes.extend_from_slice(&qh.to_le_bytes());
            }
            for _ in 0..kind.qs_bytes() {
                bytes.push(match mode {
                    0 => 0x00,
                    1 => 0xFF,
                    2 if kind == QKind::Q8_0 => 0x80,
                    3 if kind == QKind::Q8_0 => 0x7F,
                    _ => next() as u8,
                });
            }
            w.put_block(blk / nb, blk % nb, &bytes);
        }
        w
    }

    /// Activation rows: random, zero, one huge value (the rest quantize to 0), all at ±amax,
    /// large and tiny magnitudes.
    fn raw_rows(m: usize, k: usize, seed: u64) -> Vec<f32> {
        let mut x = pseudo(m * k, seed);
        for (i, row) in x.chunks_exact_mut(k).enumerate() {
            match i % 6 {
                1 => row.iter_mut().for_each(|v| *v = 0.0),
                2 => row[k / 2] = 1e6,
                3 => row
                    .iter_mut()
                    .enumerate()
                    .for_each(|(t, v)| *v = if t % 3 == 0 { 5.0 } else { -5.0 }),
                4 => row.iter_mut().for_each(|v| *v *= 3e4),
                5 => row.iter_mut().for_each(|v| *v *= 1e-20),
                _ => {}
            }
        }
        x
    }

    /// Every path (the VNNI tile kernel, the AVX2 kernel, the portable code) against the
    /// portable per-row definition, bit for bit, for m = 1..=33, row counts that end inside a
    /// group and several block counts, on random and extreme weights and activations.
    #[test]
    fn all_paths_match_portable_bitwise() {
        use super::super::KernelPath;
        let kinds = [QKind::Q4_0, QKind::Q4_1, QKind::Q5_0, QKind::Q5_1, QKind::Q8_0];
        for kind in kinds {
            for (n, nb) in [(21usize, 1usize), (19, 3), (13, 7), (41, 18), (75, 37)] {
                let k = nb * QK;
                let w = raw_weight(kind, n, k, 11 + n as u64);
                for m in 1..=33usize {
                    let x = raw_rows(m, k, 100 + m as u64);
                    let want: Vec<u32> = x
                        .chunks_exact(k)
                        .flat_map(|xr| {
                            let q = quantize_row(xr);
                            (0..n).map(move |j| (j, q.clone()))
                        })
                        .map(|(j, q)| w.dot_portable(j, &q).to_bits())
                        .collect();
                    for path in [KernelPath::Best, KernelPath::Avx2, KernelPath::Portable] {
                        let got: Vec<u32> = w.matmul_on(&x, m, path).iter().map(|v| v.to_bits()).collect();
                        if got != want {
                            let at = got.iter().zip(&want).position(|(a, b)| a != b).unwrap();
                            panic!(
                                "{kind:?} n={n} nb={nb} m={m} {path:?}: element [{}, {}] {} vs portable {}",
                                at / n,
                                at % n,
                                f32::from_bits(got[at]),
                                f32::from_bits(want[at])
                            );
                        }
                    }
                }
            }
        }
    }

    /// ggml's arithmetic ([`with_ggml_arithmetic`]): the AVX2 rows against the portable code, bit
    /// for bit, on random and extreme values; and against the serving arithmetic, which differs
    /// only by rounding.
    #[test]
    fn ggml_arithmetic_paths_agree() {
        use super::super::KernelPath;
        for kind in [QKind::Q4_0, QKind::Q4_1, QKind::Q5_0, QKind::Q5_1, QKind::Q8_0] {
            let (n, nb) = (19usize, 9usize);
            let k = nb * QK;
            let w = raw_weight(kind, n, k, 5);
            for m in [1usize, 4, 7] {
                let x = raw_rows(m, k, 60 + m as u64);
                let q: Vec<QuantRow> = x.chunks_exact(k).map(quantize_row).collect();
                let want: Vec<u32> = q
                    .iter()
                    .flat_map(|r| (0..n).map(|j| ggml::dot_portable(&w, j, r).to_bits()))
                    .collect();
                let got: Vec<u32> = with_ggml_arithmetic(true, || w.matmul_on(&x, m, KernelPath::Best))
                    .iter()
                    .map(|v| v.to_bits())
                    .collect();
                assert_eq!(got, want, "{kind:?} m={m}");
            }
            let xr = pseudo(k, 8);
            let q = quantize_row(&xr);
            for j in 0..n {
                let (a, b) = (ggml::dot_portable(&w, j, &q), w.dot_portable(j, &q));
                let scale: f32 = (0..nb)
                    .map(|blk| {
                        let s = w.slot(j, blk);
                        let v = w.block_values(j, blk);
                        let d = (f16::from_bits(w.d[s]).to_f32() * q.d[blk]).abs();
                        let m = if kind.has_min() {
                            (f16::from_bits(w.m[s]).to_f32() * q.s[blk]).abs()
                        } else {
                            0.0
                        };
                        v.iter()
                            .zip(&q.qs[blk * QK..])
                            .map(|(&a, &c)| (a * c as i32).unsigned_abs() as f32)
                            .sum::<f32>()
                            * d
                            + m
                    })
                    .sum();
                assert!((a - b).abs() <= 1e-5 * scale.max(1e-30), "{kind:?} row {j}: {a} vs {b}");
            }
        }
    }

    /// The vector `hsum_float_8` of the K-quant kernels against the scalar one, on values whose
    /// sums round differently in another order, signed zeros and infinities.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_hsum_is_hsum8() {
        if !super::super::has_avx512_vnni() {
            return;
        }
        let special = [
            0.0f32,
            -0.0,
            1e30,
            -1e30,
            1.0,
            3e-39,
            f32::INFINITY,
            1e-8,
            16_777_216.0,
            0.1,
        ];
        let mut vals = pseudo(16 * 400, 4);
        for (i, v) in vals.iter_mut().enumerate() {
            *v = match i % 7 {
                0 => special[i / 7 % special.len()],
                1 => *v * 1e8,
                _ => *v,
            };
        }
        for c in vals.chunks_exact(16) {
            // SAFETY: AVX-512 was detected above; `c` holds 16 floats.
            let (a, b) = unsafe {
                use std::arch::x86_64::_mm512_loadu_ps;
                vnni_impl::hsum_halves(_mm512_loadu_ps(c.as_ptr()))
            };
            let want_a = hsum8(c[..8].try_into().unwrap());
            let want_b = hsum8(c[8..].try_into().unwrap());
            assert_eq!(
                (a.to_bits(), b.to_bits()),
                (want_a.to_bits(), want_b.to_bits()),
                "{c:?}"
            );
        }
    }

    /// Process CPU time in seconds (Linux), else wall time since the first call.
    use super::super::cpu_seconds;

    /// Q4_1 / Q8_0 / Q5_0 products on a 1536 × 576 matrix (SmolLM2's FFN up shape) and a
    /// 4608 × 1536 one, per row count and path: best of 3 process-CPU times, and ns per (weight
    /// row, activation row, block). One thread, inside the pool as the model runs them:
    /// `cargo test --release -p specula-engine --lib kernels::qmatmul::tests::speed -- --ignored --nocapture --exact`
    #[test]
    #[ignore]
    fn speed() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        pool.install(speed_in_pool);
    }

    fn speed_in_pool() {
        use super::super::KernelPath;
        for (n, k) in [(1536usize, 576usize), (4608, 1536)] {
            for dt in [GgmlDType::Q4_1, GgmlDType::Q8_0, GgmlDType::Q5_0] {
                let (q, _) = weight(dt, n, k);
                let w = QWeight::from_qtensor(&q).unwrap().unwrap();
                for path in [KernelPath::Avx2, KernelPath::Best] {
                    let mut line = format!("{dt:?} {n}x{k} {path:?}:");
                    for m in [1usize, 2, 4, 8, 9, 16, 32, 64] {
                        let x = pseudo(m * k, 5);
                        let reps = (200 / m).max(4);
                        let best = (0..3)
                            .map(|_| {
                                let t = cpu_seconds();
                                for _ in 0..reps {
                                    std::hint::black_box(w.matmul_on(&x, m, path));
                                }
                                (cpu_seconds() - t) / reps as f64
                            })
                            .fold(f64::MAX, f64::min);
                        let per = best / (n * m * (k / QK)) as f64 * 1e9;
                        line.push_str(&format!(" m={m}: {:.3} ms ({per:.2} ns)", best * 1e3));
                    }
                    eprintln!("{line}");
                }
            }
        }
    }

    /// Products on matrices larger than the L3 cache (weights streamed from memory), per path:
    /// `cargo test --release -p specula-engine --lib qmatmul::tests::speed_streamed -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn speed_streamed() {
        use super::super::KernelPath;
        for (dt, n, k) in [
            (GgmlDType::Q8_0, 65536usize, 896usize),
            (GgmlDType::Q5_0, 4864, 4864),
            (GgmlDType::Q4_1, 1536, 9216),
        ] {
            let w = QWeight::from_qtensor(&weight(dt, n, k).0).unwrap().unwrap();
            let copies: Vec<QWeight> = (0..4).map(|_| w.clone()).collect();
            let bytes = n * (k / QK) * dt.type_size();
            for m in [1usize, 2, 8] {
                let x = pseudo(m * k, 5);
                for path in [KernelPath::Avx2, KernelPath::Best] {
                    let t = std::time::Instant::now();
                    for _ in 0..5 {
                        for c in &copies {
                            std::hint::black_box(c.matmul_on(&x, m, path));
                        }
                    }
                    let per = t.elapsed().as_secs_f64() / 20.0;
                    let gbs = bytes as f64 / per / 1e9;
                    eprintln!("{dt:?} {n}x{k} m={m} {path:?}: {:.3} ms ({gbs:.1} GB/s)", per * 1e3);
                }
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

    /// The AVX-512 and AVX2 block quantizations give the scalar definition's bytes, scales and
    /// sums, over random blocks, ties, zeros, tiny and huge magnitudes.
    #[test]
    fn simd_quantization_matches_scalar() {
        #[cfg(target_arch = "x86_64")]
        {
            let (avx512, avx2) = (crate::kernels::kquants::has_avx512(), has_avx2());
            if !avx512 && !avx2 {
                return;
            }
            let mut st = 0x9E37_79B9_7F4A_7C15u64;
            let mut next = || {
                st ^= st << 13;
                st ^= st >> 7;
                st ^= st << 17;
                st
            };
            for case in 0..4000 {
                let scale = [1e-30f32, 1e-3, 1.0, 37.0, 1e20][case % 5];
                let mut x: Vec<f32> = (0..QK)
                    .map(|_| ((next() % 20001) as f32 - 10000.0) / 10000.0 * scale)
                    .collect();
                match case % 7 {
                    0 => x.iter_mut().for_each(|v| *v = 0.0),
                    1 => {
                        // Exact halves after scaling: amax 127 makes id = 1.
                        x[0] = 127.0;
                        for (i, v) in x.iter_mut().enumerate().skip(1) {
                            *v = (i as f32 - 16.0) + 0.5;
                        }
                    }
                    2 => x[(next() % 32) as usize] = -0.0,
                    _ => {}
                }
                // Past the finite range: a block below 127 / f32::MAX (an infinite 127 / amax)
                // and non-finite lanes; the SIMD paths keep the scalar's bytes and sum there too.
                let extreme = case % 13 == 12;
                if extreme {
                    match case % 3 {
                        0 => x.iter_mut().for_each(|v| *v *= 1e-38 / scale),
                        1 => x[(next() % 32) as usize] = f32::INFINITY,
                        _ => x[(next() % 32) as usize] = f32::NAN,
                    }
                }
                let mut q1 = [0i8; QK];
                let a = quantize_block(&x, &mut q1);
                let mut simd: Vec<(&str, [i8; QK], (f32, i32))> = Vec::new();
                if avx512 {
                    let mut q = [0i8; QK];
                    // SAFETY: AVX-512 F is present (checked above).
                    let b = unsafe { quantize_block_avx512(&x, &mut q) };
                    simd.push(("avx512", q, b));
                }
                if avx2 {
                    let mut q = [0i8; QK];
                    // SAFETY: AVX2 is present (checked above).
                    let b = unsafe { quant_avx2::quantize_block(&x, &mut q) };
                    simd.push(("avx2", q, b));
                }
                for (isa, q2, b) in simd {
                    assert_eq!(q1, q2, "{isa} case {case}");
                    assert_eq!(a.0.to_bits(), b.0.to_bits(), "{isa} case {case} {x:?}");
                    assert_eq!(a.1, b.1, "{isa} case {case}");
                }
            }
        }
    }
}
