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
//! **Paths.** The portable path ([`vec_dot_portable`]) is the reference; the AVX2 path is ggml's
//! loop (`maddubs` + `madd`), sharing each weight block's unpacking between 4 activation rows
//! ([`vec_dot4`]). Where AVX-512 VNNI is available, every product runs on a tile kernel
//! (`vnni_impl`): two weight rows per 512-bit register times up to [`VNNI_ROWS`] activation rows
//! (8 weight rows × 1 for decode), the integer lanes by one `vpdpbusd` per (weight row pair, row,
//! block) over the weights encoded unsigned (`w + bias`, the exact `-bias * sum(q)` of each lane
//! precomputed per activation row as the accumulator's start), the float steps of both weight rows
//! in one register. `SPECULA_KERNELS=avx2` / `=portable` force the other paths.
//!
//! **Batch invariance.** Every output element is computed by the same function of one weight row
//! and one activation row, whatever the number of rows `m`: a row of an m-row product is bitwise
//! equal to the 1-row product. All paths compute the same exact integer lane sums (the Q8 quants
//! are in -127..=127, so no `maddubs` pair saturates) and the same float operations in the same
//! order, so they agree bitwise too (tested).

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

    /// The weight rows `ids`, in that order, as a new `[ids.len(), k]` weight (the blocks copied
    /// unchanged, so each output is bitwise what the full product gives at that row). Panics if
    /// an id is not below `n`.
    pub fn select_rows(&self, ids: &[u32]) -> Self {
        let per = self.k / QK;
        let qs_len = self.kind.qs_bytes();
        let pick = |v: &[u16]| -> Vec<u16> {
            if v.is_empty() {
                return Vec::new();
            }
            ids.iter()
                .flat_map(|&j| &v[j as usize * per..][..per])
                .copied()
                .collect()
        };
        Self {
            kind: self.kind,
            n: ids.len(),
            k: self.k,
            d: pick(&self.d),
            m: pick(&self.m),
            qs: ids
                .iter()
                .flat_map(|&j| &self.qs[j as usize * per * qs_len..][..per * qs_len])
                .copied()
                .collect(),
            qh: if self.qh.is_empty() {
                Vec::new()
            } else {
                ids.iter()
                    .flat_map(|&j| &self.qh[j as usize * per..][..per])
                    .copied()
                    .collect()
            },
        }
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

    fn job_on(&self, x: &[f32], m: usize, path: super::KernelPath) -> super::TileJob<'_> {
        assert_eq!(
            x.len(),
            m * self.k,
            "matmul: x has {} floats, expected {m} x {}",
            x.len(),
            self.k
        );
        let rows: Vec<QuantRow> = x.chunks_exact(self.k).map(quantize_row).collect();
        #[cfg(target_arch = "x86_64")]
        // On AMD Zen 4 and earlier (512-bit operations split in two), one row of a large Q8_0 /
        // Q5_0 matrix (an LM head) streams faster from memory row by row through the AVX2 kernel
        // than eight rows at a time through the tile (`speed_streamed`: Q8_0 38 vs 31 GB/s, Q5_0
        // 30 vs 19 on the 2-core EPYC VM; Q4_1 the other way, 16 vs 30), while a cache-resident
        // one is 3x faster in the tile (`speed`). On the Intel Xeon (Sapphire Rapids) VM the
        // tile wins there too (Q8_0 at 2 threads: 2.8-3.7 vs 3.9-6.5 ms). Same bits either way.
        {
            let bytes = self.qs.len() + 2 * self.d.len();
            let row_by_row = m == 1
                && bytes >= 8 << 20
                && matches!(self.kind, QKind::Q8_0 | QKind::Q5_0)
                && super::splits_512bit_ops();
            if path == super::KernelPath::Best && super::has_avx512_vnni() && !row_by_row {
                return self.job_vnni(rows);
            }
        }
        let avx2 = has_avx2() && path != super::KernelPath::Portable;
        let groups = super::fixed_groups(m, 4);
        super::TileJob::new(self.n, self.k, m, groups, 1, move |j, _, (_, i0, g), out| {
            let xs = &rows[i0..i0 + g];
            if let Ok(x4) = <&[QuantRow; 4]>::try_from(xs) {
                out.copy_from_slice(&vec_dot4(self.row(j), [&x4[0], &x4[1], &x4[2], &x4[3]], avx2));
            } else {
                for (o, x) in out.iter_mut().zip(xs) {
                    *o = vec_dot(self.row(j), x, avx2);
                }
            }
        })
    }

    /// The product on the AVX-512 VNNI tile kernel ([`vnni_impl::tile`]): tiles of 2 to 8 weight
    /// rows × up to [`VNNI_ROWS`] activation rows.
    #[cfg(target_arch = "x86_64")]
    fn job_vnni(&self, rows: Vec<QuantRow>) -> super::TileJob<'_> {
        let m = rows.len();
        let groups = super::row_groups(m, VNNI_ROWS);
        let acts = Acts::new(self.kind, rows, groups.clone(), self.k / QK);
        let wtile = if m == 1 { 8 } else { 2 * vnni_impl::WIDE };
        super::TileJob::new(self.n, self.k, m, groups, wtile, move |j0, nw, (gi, _, _), out| {
            // SAFETY: AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C were detected at run time
            // (`has_avx512_vnni`); the tile's rows and blocks are in range (checked inside).
            unsafe { vnni_impl::tile_dispatch(self, &acts, j0, nw, gi, out) }
        })
    }
}

/// Largest activation row group of the VNNI tile kernel.
pub const VNNI_ROWS: usize = 8;

/// Activation rows prepared for the VNNI kernel: the quantized rows, and per row and block the
/// exact integer correction of the unsigned weight encoding (`-bias * sum of quants 4l..4l+3`
/// in lane `l`: the kernel multiplies `w + bias` ≥ 0, as `vpdpbusd` needs), and per row group the
/// Q8_1 sums `s` transposed to `[block][row]`.
struct Acts {
    rows: Vec<QuantRow>,
    groups: Vec<(usize, usize)>,
    nb: usize,
    /// `[row][block][lane]` (empty for the `_1` kinds, whose weights are unsigned already).
    corr: Vec<i32>,
    /// `[group][block][VNNI_ROWS]`, zero-padded (empty unless the kind has a min).
    s_t: Vec<f32>,
}

impl Acts {
    fn new(kind: QKind, rows: Vec<QuantRow>, groups: Vec<(usize, usize)>, nb: usize) -> Self {
        let bias = match kind {
            QKind::Q4_0 => 8,
            QKind::Q5_0 => 16,
            QKind::Q8_0 => 128,
            QKind::Q4_1 | QKind::Q5_1 => 0,
        };
        let mut corr = Vec::new();
        if bias != 0 {
            corr.reserve(rows.len() * nb * 8);
            for x in &rows {
                for q in x.qs.chunks_exact(4) {
                    let s: i32 = q.iter().map(|&v| v as i32).sum();
                    corr.push(-bias * s);
                }
            }
        }
        let mut s_t = Vec::new();
        if kind.has_min() {
            s_t = vec![0f32; groups.len() * nb * VNNI_ROWS];
            for (gi, &(i0, g)) in groups.iter().enumerate() {
                for r in 0..g {
                    for b in 0..nb {
                        s_t[(gi * nb + b) * VNNI_ROWS + r] = rows[i0 + r].s[b];
                    }
                }
            }
        }
        Self {
            rows,
            groups,
            nb,
            corr,
            s_t,
        }
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

#[cfg(target_arch = "x86_64")]
pub(crate) mod vnni_impl {
    //! The AVX-512 VNNI tile kernel: 2 weight rows per 512-bit register (row `a` in the low 256
    //! bits, row `b` in the high), times 1..=8 activation rows broadcast to both halves. Per
    //! (weight row, activation row, block) the eight i32 lanes are the exact integer sums of
    //! ggml's lanes (`vpdpbusd` over the weights encoded unsigned, started from the exact
    //! correction of that encoding), converted and accumulated with one FMA by `d_w * d_x`, in
    //! block order; the final reduction is `hsum_float_8` plus the `m_w * s_x` sum: the float
    //! operations of [`vec_dot`](super::vec_dot), lane for lane.

    use super::*;
    use std::arch::x86_64::*;

    /// f16 bits `a`, `b` → `[f32(a) × 8, f32(b) × 8]` (F16C conversion: exact).
    #[inline(always)]
    pub(crate) unsafe fn f16_pair(a: u16, b: u16) -> __m512 {
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128((a as u32 | (b as u32) << 16) as i32));
        let idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(v))
    }

    /// The nibbles of two blocks' 16 packed bytes `qa`, `qb`: `[qa & 15, qa >> 4, qb & 15,
    /// qb >> 4]` (16 bytes each: values 0..16 then 16..32 of each block).
    #[inline(always)]
    unsafe fn nib2(qa: *const u8, qb: *const u8) -> __m512i {
        let t = _mm256_inserti128_si256::<1>(
            _mm256_castsi128_si256(_mm_loadu_si128(qa as *const __m128i)),
            _mm_loadu_si128(qb as *const __m128i),
        );
        let z = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(t), _mm256_srli_epi16::<4>(t));
        let z = _mm512_shuffle_i64x2::<0b11_01_10_00>(z, z);
        _mm512_and_si512(z, _mm512_set1_epi8(0x0F))
    }

    /// [`QKind`] as a const generic parameter.
    const Q4_0: u8 = 0;
    const Q4_1: u8 = 1;
    const Q5_0: u8 = 2;
    const Q5_1: u8 = 3;
    const Q8_0: u8 = 4;

    /// Block `b` of two weight rows (`ba`, `bb`: the blocks' indices in the whole matrix) in the
    /// low and high halves, as unsigned bytes `w + bias` (`bias` 0 for the `_1` kinds, 8 / 16 /
    /// 128 for Q4_0 / Q5_0 / Q8_0).
    #[inline(always)]
    unsafe fn weights2<const K: u8>(qs: *const u8, qh: *const u32, ba: usize, bb: usize) -> __m512i {
        match K {
            Q4_0 | Q4_1 => nib2(qs.add(ba * 16), qs.add(bb * 16)),
            Q5_0 | Q5_1 => {
                let z = nib2(qs.add(ba * 16), qs.add(bb * 16));
                let h = *qh.add(ba) as u64 | (*qh.add(bb) as u64) << 32;
                _mm512_mask_add_epi8(z, _cvtu64_mask64(h), z, _mm512_set1_epi8(16))
            }
            _ => {
                let lo = _mm256_loadu_si256(qs.add(ba * 32) as *const __m256i);
                let hi = _mm256_loadu_si256(qs.add(bb * 32) as *const __m256i);
                let z = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
                _mm512_xor_si512(z, _mm512_set1_epi8(0x80u8 as i8))
            }
        }
    }

    /// ggml's `hsum_float_8`, `((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7))`, of each 256-bit half,
    /// as the two values (low half, high half): the same additions in the same order, four lanes
    /// at a time.
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

    /// Tiles ahead that the tiles prefetch (one-row tile: 1 and 2 measured alike, 3 and 4
    /// slower).
    const PREFETCH_TILES: usize = 2;

    /// Prefetch, at block `b` of a tile, part of a later tile of `rows` weight rows starting at
    /// block `ahead` (`(first row) * nb`). A tile's rows follow each other in memory, so its
    /// quants are one contiguous run of `rows * nb` blocks: at block `b` this fetches that run's
    /// blocks `rows * b .. rows * (b + 1)`, and at the first block the tile's scales (and mins,
    /// and Q5's high bits). A row is only a few hundred bytes, so the earlier prefetch, 256 bytes
    /// ahead within each of the tile's own rows, ran barely ahead of the loads and every tile
    /// started cold; this took SmolLM2's 2-thread decode from 100-115 to 142-166 tok/s
    /// (docs/perf.md). A prefetch past the end of the matrix is harmless: it never faults.
    #[inline(always)]
    unsafe fn prefetch_run<const K: u8>(w: &QWeight, ahead: usize, rows: usize, b: usize, nb: usize) {
        let has_min = K == Q4_1 || K == Q5_1;
        let qbytes = if K == Q8_0 { 32 } else { 16 };
        let pq = w.qs.as_ptr().wrapping_add((ahead + b * rows) * qbytes);
        for l in (0..rows * qbytes).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(pq.wrapping_add(l) as *const i8);
        }
        if b == 0 {
            let (wd, wm) = (w.d.as_ptr().wrapping_add(ahead), w.m.as_ptr().wrapping_add(ahead));
            for l in (0..rows * nb * 2).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>((wd as *const i8).wrapping_add(l));
                if has_min {
                    _mm_prefetch::<_MM_HINT_T0>((wm as *const i8).wrapping_add(l));
                }
            }
            if K == Q5_0 || K == Q5_1 {
                let qh = w.qh.as_ptr().wrapping_add(ahead) as *const i8;
                for l in (0..rows * nb * 4).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>(qh.wrapping_add(l));
                }
            }
        }
    }

    /// One tile: weight rows `j0 .. j0 + nw` (`nw` ≤ `2 * WP`; missing rows of the last pair
    /// repeat the last row, their results dropped) × the `R` rows of group `gi` (from row `i0`);
    /// `out[w * R + r]`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile<const K: u8, const WP: usize, const R: usize>(
        w: &QWeight,
        a: &Acts,
        j0: usize,
        nw: usize,
        i0: usize,
        gi: usize,
        out: &mut [f32],
    ) {
        let nb = a.nb;
        let has_min = K == Q4_1 || K == Q5_1;
        let jr = |t: usize| (j0 + t.min(nw - 1)) * nb;
        let row_a: [usize; WP] = std::array::from_fn(|p| jr(2 * p));
        let row_b: [usize; WP] = std::array::from_fn(|p| jr(2 * p + 1));
        let yq: [*const i8; R] = std::array::from_fn(|r| a.rows[i0 + r].qs.as_ptr());
        let yd: [*const f32; R] = std::array::from_fn(|r| a.rows[i0 + r].d.as_ptr());
        let cq: [*const i32; R] = std::array::from_fn(|r| {
            if has_min {
                std::ptr::null()
            } else {
                a.corr.as_ptr().add((i0 + r) * nb * 8)
            }
        });
        let st = if has_min {
            a.s_t.as_ptr().add(gi * nb * VNNI_ROWS)
        } else {
            std::ptr::null()
        };
        let (qs, qh, wd, wm) = (w.qs.as_ptr(), w.qh.as_ptr(), w.d.as_ptr(), w.m.as_ptr());
        let mut acc = [[_mm512_setzero_ps(); R]; WP];
        let mut summs = [_mm512_setzero_ps(); WP];
        // With one row group (a verify block of up to eight rows) the tiles run through the
        // chunk's weight rows in order, as the one-row tile's do: prefetch the tile two on.
        // With several, each panel of weight rows is read from memory by the first group and
        // from cache by the others: the first group's tiles prefetch their rows of the next
        // panel, which the other groups' tiles give time to arrive.
        let ahead = match (a.groups.len(), gi) {
            (1, _) => Some(j0 + PREFETCH_TILES * 2 * WP),
            (_, 0) => Some(j0 + crate::kernels::PANEL),
            _ => None,
        };
        for b in 0..nb {
            let mut wv = [_mm512_setzero_si512(); WP];
            let mut dw = [_mm512_setzero_ps(); WP];
            let mut mw = [_mm512_setzero_ps(); WP];
            if let Some(j) = ahead {
                prefetch_run::<K>(w, j * nb, 2 * WP, b, nb);
            }
            for p in 0..WP {
                let (ba, bb) = (row_a[p] + b, row_b[p] + b);
                wv[p] = weights2::<K>(qs, qh, ba, bb);
                dw[p] = f16_pair(*wd.add(ba), *wd.add(bb));
                if has_min {
                    mw[p] = f16_pair(*wm.add(ba), *wm.add(bb));
                }
            }
            for r in 0..R {
                let y = _mm512_broadcast_i64x4(_mm256_loadu_si256(yq[r].add(b * QK) as *const __m256i));
                let c = if has_min {
                    _mm512_setzero_si512()
                } else {
                    _mm512_broadcast_i64x4(_mm256_loadu_si256(cq[r].add(b * 8) as *const __m256i))
                };
                let dx = _mm512_set1_ps(*yd[r].add(b));
                for p in 0..WP {
                    let lanes = _mm512_dpbusd_epi32(c, wv[p], y);
                    acc[p][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes), _mm512_mul_ps(dw[p], dx), acc[p][r]);
                }
            }
            if has_min {
                let s = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(
                    st.add(b * VNNI_ROWS) as *const f64
                )));
                for p in 0..WP {
                    summs[p] = _mm512_fmadd_ps(mw[p], s, summs[p]);
                }
            }
        }
        for p in 0..WP {
            let mut sm = [0f32; 16];
            _mm512_storeu_ps(sm.as_mut_ptr(), summs[p]);
            for r in 0..R {
                let (ha, hb) = hsum_halves(acc[p][r]);
                for (h, v) in [(0, ha), (1, hb)] {
                    let t = 2 * p + h;
                    if t < nw {
                        out[t * R + r] = v + sm[8 * h + r];
                    }
                }
            }
        }
    }

    /// [`tile`] for one activation row and 8 weight rows (a decode step), with the scales
    /// converted 16 blocks at a time: each weight row's f16 `d` (and `m`) of 16 consecutive
    /// blocks in one `vcvtph2ps`, `d_w · d_x` for the 16 blocks in one multiply, instead of per
    /// block and row pair. At one row the per-block scale work was half the instructions of the
    /// tile. The products, sums and their order are [`tile`]'s: `d_w · d_x` is the same single
    /// rounding of the same two floats, so every output bit is unchanged.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile1<const K: u8>(w: &QWeight, a: &Acts, j0: usize, nw: usize, i0: usize, gi: usize, out: &mut [f32]) {
        const WP: usize = 4;
        const CH: usize = 16;
        let nb = a.nb;
        let has_min = K == Q4_1 || K == Q5_1;
        let base: [usize; 2 * WP] = std::array::from_fn(|t| (j0 + t.min(nw - 1)) * nb);
        let yq = a.rows[i0].qs.as_ptr();
        let yd = a.rows[i0].d.as_ptr();
        let cq = if has_min {
            std::ptr::null()
        } else {
            a.corr.as_ptr().add(i0 * nb * 8)
        };
        let st = if has_min {
            a.s_t.as_ptr().add(gi * nb * VNNI_ROWS)
        } else {
            std::ptr::null()
        };
        let (qs, qh, wd, wm) = (w.qs.as_ptr(), w.qh.as_ptr(), w.d.as_ptr(), w.m.as_ptr());
        let mut acc = [_mm512_setzero_ps(); WP];
        let mut summs = [_mm512_setzero_ps(); WP];
        // Per weight row, for the blocks of the chunk: `d_w · d_x` and `m_w`.
        let mut ds = [[0f32; CH]; 2 * WP];
        let mut ms = [[0f32; CH]; 2 * WP];
        for b0 in (0..nb).step_by(CH) {
            let nc = CH.min(nb - b0);
            let mask = (1u32 << nc) - 1;
            let dx = _mm512_maskz_loadu_ps(mask as u16, yd.add(b0));
            for t in 0..2 * WP {
                let h = _mm256_maskz_loadu_epi16(mask as u16, wd.add(base[t] + b0) as *const i16);
                _mm512_storeu_ps(ds[t].as_mut_ptr(), _mm512_mul_ps(_mm512_cvtph_ps(h), dx));
                if has_min {
                    let h = _mm256_maskz_loadu_epi16(mask as u16, wm.add(base[t] + b0) as *const i16);
                    _mm512_storeu_ps(ms[t].as_mut_ptr(), _mm512_cvtph_ps(h));
                }
            }
            for c in 0..nc {
                let b = b0 + c;
                prefetch_run::<K>(w, base[0] + PREFETCH_TILES * 8 * nb, 8, b, nb);
                let y = _mm512_broadcast_i64x4(_mm256_loadu_si256(yq.add(b * QK) as *const __m256i));
                let corr = if has_min {
                    _mm512_setzero_si512()
                } else {
                    _mm512_broadcast_i64x4(_mm256_loadu_si256(cq.add(b * 8) as *const __m256i))
                };
                for p in 0..WP {
                    let wv = weights2::<K>(qs, qh, base[2 * p] + b, base[2 * p + 1] + b);
                    let sc =
                        _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(ds[2 * p][c]), _mm512_set1_ps(ds[2 * p + 1][c]));
                    let lanes = _mm512_dpbusd_epi32(corr, wv, y);
                    acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes), sc, acc[p]);
                }
                if has_min {
                    let sv = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(
                        st.add(b * VNNI_ROWS) as *const f64
                    )));
                    for p in 0..WP {
                        let mw = _mm512_mask_blend_ps(
                            0xff00,
                            _mm512_set1_ps(ms[2 * p][c]),
                            _mm512_set1_ps(ms[2 * p + 1][c]),
                        );
                        summs[p] = _mm512_fmadd_ps(mw, sv, summs[p]);
                    }
                }
            }
        }
        for p in 0..WP {
            let mut sm = [0f32; 16];
            _mm512_storeu_ps(sm.as_mut_ptr(), summs[p]);
            let (ha, hb) = hsum_halves(acc[p]);
            for (h, v) in [(0, ha), (1, hb)] {
                let t = 2 * p + h;
                if t < nw {
                    out[t] = v + sm[8 * h];
                }
            }
        }
    }

    /// [`tile`] for the kind and the group's row count.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile_rows<const K: u8>(w: &QWeight, a: &Acts, j0: usize, nw: usize, gi: usize, out: &mut [f32]) {
        let (i0, g) = a.groups[gi];
        match g {
            1 => tile1::<K>(w, a, j0, nw, i0, gi, out),
            2 => tile::<K, WIDE, 2>(w, a, j0, nw, i0, gi, out),
            3 => tile::<K, WIDE, 3>(w, a, j0, nw, i0, gi, out),
            4 => tile::<K, WIDE, 4>(w, a, j0, nw, i0, gi, out),
            5 => tile::<K, WIDE, 5>(w, a, j0, nw, i0, gi, out),
            6 => tile::<K, WIDE, 6>(w, a, j0, nw, i0, gi, out),
            7 => tile::<K, WIDE, 7>(w, a, j0, nw, i0, gi, out),
            8 => tile::<K, WIDE, 8>(w, a, j0, nw, i0, gi, out),
            _ => panic!("group of {g} rows"),
        }
    }

    /// Weight row pairs per tile for groups of 2..=8 rows.
    pub(super) const WIDE: usize = 2;

    /// One tile of the product (see [`QWeight::matmul`]): weight rows `j0 .. j0 + nw`, the rows
    /// of group `gi`, `out[w * g + r]`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn tile_dispatch(w: &QWeight, a: &Acts, j0: usize, nw: usize, gi: usize, out: &mut [f32]) {
        let nb = a.nb;
        let (i0, g) = a.groups[gi];
        let wp = if g == 1 { 4 } else { WIDE };
        assert!(
            nw >= 1 && nw <= 2 * wp && j0 + nw <= w.n && nb * QK == w.k && out.len() >= nw * g,
            "tile out of range"
        );
        for x in &a.rows[i0..i0 + g] {
            assert!(
                x.qs.len() >= nb * QK && x.d.len() >= nb,
                "activation row shorter than the weights"
            );
        }
        match w.kind {
            QKind::Q4_0 => tile_rows::<Q4_0>(w, a, j0, nw, gi, out),
            QKind::Q4_1 => tile_rows::<Q4_1>(w, a, j0, nw, gi, out),
            QKind::Q5_0 => tile_rows::<Q5_0>(w, a, j0, nw, gi, out),
            QKind::Q5_1 => tile_rows::<Q5_1>(w, a, j0, nw, gi, out),
            QKind::Q8_0 => tile_rows::<Q8_0>(w, a, j0, nw, gi, out),
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

    /// A weight matrix with random blocks, some blocks at the extremes of the encoding (all
    /// quants minimal / maximal, all high bits set), and random f16 scales and mins.
    fn raw_weight(kind: QKind, n: usize, k: usize, seed: u64) -> QWeight {
        let nb_all = n * k / QK;
        let mut st = seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1;
        let mut next = move || {
            st ^= st << 13;
            st ^= st >> 7;
            st ^= st << 17;
            st
        };
        let ql = kind.qs_bytes();
        let mut w = QWeight {
            kind,
            n,
            k,
            d: Vec::new(),
            m: Vec::new(),
            qs: Vec::new(),
            qh: Vec::new(),
        };
        for blk in 0..nb_all {
            let mode = blk % 5;
            let scale = (next() % 2000) as f32 / 1000.0 * if next() % 2 == 0 { 1.0 } else { -1.0 };
            w.d.push(f16::from_f32(scale * 0.01).to_bits());
            if kind.has_min() {
                w.m.push(f16::from_f32((next() % 2000) as f32 / 1000.0 - 1.0).to_bits());
            }
            for _ in 0..ql {
                w.qs.push(match mode {
                    0 => 0x00,
                    1 => 0xFF,
                    2 if kind == QKind::Q8_0 => 0x80,
                    3 if kind == QKind::Q8_0 => 0x7F,
                    _ => next() as u8,
                });
            }
            if matches!(kind, QKind::Q5_0 | QKind::Q5_1) {
                w.qh.push(match mode {
                    0 => 0,
                    1 => u32::MAX,
                    _ => next() as u32,
                });
            }
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

    /// Every path (the VNNI tile kernel, the AVX2 kernels, the portable code) against the
    /// portable per-row reference, bit for bit, for m = 1..=33, odd weight row counts and
    /// several block counts, on random and extreme weights and activations.
    #[test]
    fn all_paths_match_portable_bitwise() {
        use super::super::KernelPath;
        let kinds = [QKind::Q4_0, QKind::Q4_1, QKind::Q5_0, QKind::Q5_1, QKind::Q8_0];
        for kind in kinds {
            // nb past 16 and not a multiple of it: the one-row tile converts scales 16 blocks at a time.
            for (n, nb) in [(21usize, 1usize), (19, 3), (13, 7), (9, 18), (11, 37)] {
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
                        .map(|(j, q)| vec_dot_portable(w.row(j), &q).to_bits())
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

    /// The vector `hsum_float_8` of the VNNI kernel against the scalar one, on values whose
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
            let bytes = w.d.len() * dt.type_size();
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
}
