//! Q4_K and Q6_K weights interleaved by 16 rows, for the AVX-512 VNNI and AVX2 kernels that
//! compute a product of any number of activation rows (decode, verify, prefill) with lanes as
//! output features.
//!
//! **Arithmetic.** The same as [`super::kquants`]'s serving arithmetic, per output element
//! (weight row `j`, activation row `i`, quantized to Q8_K), per super-block `b` in order:
//!
//! ```text
//! Q4_K: sumi = Σ_u sc[u] · Σ_{32 values of sub-block u} q_w · q_x        (exact i32)
//!       summ = Σ_u m[u] · Σ_{32 values of sub-block u} q_x               (exact i32)
//!       sum   = fma(f32(sumi), d_w · d_x, sum)
//!       summs = fma(f32(summ), dmin_w · d_x, summs)        y = sum - summs
//! Q6_K: sumi = Σ_s sc[s] · Σ_{16 values of sub-block s} (q_w - 32) · q_x (exact i32)
//!       acc = fma(f32(sumi) · d_w, d_x, acc)                             y = acc
//! ```
//!
//! Q4_K's is llama.cpp's one-row arithmetic for it (`ggml_gemv_q4_K_8x8_q8_K`, the repacked
//! kernel every AVX2 CPU runs); Q6_K's is llama.cpp's tiled batch kernel (`ggml/src/ggml-cpu/
//! tiled/`), one float chain per output instead of `ggml_vec_dot_q6_K_q8_K`'s eight lanes.
//! [`super::kquants::vec_dot_portable`] is the definition; the kernels here equal it bit for
//! bit (tested).
//!
//! **Layout.** Per group of 16 weight rows and super-block, each array holds the 16 rows side by
//! side in units of 4 bytes (`[unit][row][4]`), so one 512-bit load is one unit of all 16 rows
//! and a `vpdpbusd` against 4 activation bytes broadcast adds 4 products to each row's sum (the
//! AVX2 tiles read each unit as two 256-bit halves of 8 rows and use `maddubs`):
//!
//! - Q4_K (144 bytes a row, as ggml): `d`, `dmin` (f16 bits, `[16]` each); the 12 packed
//!   scale/min bytes (3 units); the 128 quant bytes as ggml stores them (32 units: byte `32c + l`
//!   holds value `64c + l` in its low nibble and `64c + 32 + l` in its high one).
//! - Q6_K (210 bytes a row, as ggml): `d` (`[16]`); the 16 signed scales in pairs (`[8][row][2]`);
//!   `ql`, 128 bytes, byte `p` = the low 4 bits of value `p` (low nibble) and of value `p + 128`
//!   (high nibble); `qh`, 64 bytes, byte `p` = the high 2 bits of values `p`, `p + 64`,
//!   `p + 128`, `p + 192` (bits 0-1, 2-3, 4-5, 6-7). This is ggml's information rearranged so
//!   that 4 consecutive values share one unit.
//!
//! The conversion from and to ggml's super-blocks is exact (round trip tested), so the weights
//! take the same memory as in the file.

use super::kquants::{q6k_values, KKind, Q8KRow, QK_K};

/// Weight rows per interleaved group (the 16 i32 lanes of a 512-bit register).
pub const GROUP: usize = 16;

/// Activation rows per tile of the VNNI kernel. 4, 6 and 8 measured alike up to 6 rows on the
/// Qwen2.5-Coder-1.5B (2-core Zen 5 VM); 8 was fastest for 7-9 rows (a verify of k = 6..8).
pub const TILE_ROWS: usize = 8;

/// A Q4_K or Q6_K weight `[n, k]` (`k` a multiple of 256) interleaved by [`GROUP`] rows (module
/// docs). Rows past `n` in the last group are zero.
#[derive(Debug, Clone)]
pub struct KWide {
    kind: KKind,
    n: usize,
    k: usize,
    /// Super-blocks per row.
    nb: usize,
    /// The records, one per (group, super-block), group-major: one stream for the kernels.
    data: Vec<Line>,
}

/// 64 bytes, 64-aligned: the unit of [`KWide`]'s storage (records start on cache lines).
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// Where each part of a (group, super-block) record is: byte offsets, and the record's size.
struct Record {
    ql: usize,
    qh: usize,
    sc: usize,
    d: usize,
    dmin: usize,
    size: usize,
}

/// Q4_K: quants, packed scales, `d`, `dmin` (16 × 144 bytes).
const Q4K_REC: Record = Record {
    ql: 0,
    qh: 0,
    sc: 2048,
    d: 2240,
    dmin: 2272,
    size: 2304,
};

/// Q6_K: low quants, high quants, scales, `d` (16 × 210 bytes), padded to whole cache lines.
const Q6K_REC: Record = Record {
    ql: 0,
    qh: 2048,
    sc: 3072,
    d: 3328,
    dmin: 0,
    size: 3392,
};

/// Bytes per row and super-block of the scales, low quants and high quants.
const Q4K_SC: usize = 12;
const Q6K_SC: usize = 16;
const QL: usize = 128;
const QH: usize = 64;

impl KWide {
    /// Whether a weight of `kind` can take this layout.
    pub fn supports(kind: KKind) -> bool {
        matches!(kind, KKind::Q4K | KKind::Q6K)
    }

    fn rec(&self) -> &'static Record {
        if self.kind == KKind::Q6K {
            &Q6K_REC
        } else {
            &Q4K_REC
        }
    }

    fn zeros(kind: KKind, n: usize, k: usize) -> Self {
        assert!(
            Self::supports(kind) && k.is_multiple_of(QK_K),
            "KWide: {kind:?} with k = {k}"
        );
        let nb = k / QK_K;
        let groups = n.div_ceil(GROUP);
        let mut w = Self {
            kind,
            n,
            k,
            nb,
            data: Vec::new(),
        };
        w.data = vec![Line([0; 64]); groups * nb * w.rec().size / 64];
        w
    }

    /// From ggml super-blocks, row-major (`n * k / 256` blocks of [`KKind::block_bytes`]).
    /// Panics if `data` is not that long or the kind has no wide layout.
    pub fn from_ggml(kind: KKind, n: usize, k: usize, data: &[u8]) -> Self {
        let mut w = Self::zeros(kind, n, k);
        let bb = kind.block_bytes();
        assert_eq!(data.len(), n * w.nb * bb, "KWide: super-block bytes");
        for (i, blk) in data.chunks_exact(bb).enumerate() {
            w.put_block(i / w.nb, i % w.nb, blk);
        }
        w
    }

    pub fn kind(&self) -> KKind {
        self.kind
    }

    /// `(n, k)`: output features, input features.
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `Line` is 64 plain bytes (`repr(C)`), so the vector is `64 * len` bytes.
        unsafe { std::slice::from_raw_parts(self.data.as_ptr() as *const u8, self.data.len() * 64) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and the borrow is unique.
        unsafe { std::slice::from_raw_parts_mut(self.data.as_mut_ptr() as *mut u8, self.data.len() * 64) }
    }

    /// Offset of byte `p` of (row `j`, super-block `b`) in the part at `part` of the record,
    /// stored in units of `unit` bytes.
    #[inline]
    fn at(&self, j: usize, b: usize, part: usize, p: usize, unit: usize) -> usize {
        ((j / GROUP) * self.nb + b) * self.rec().size + part + (p / unit) * GROUP * unit + (j % GROUP) * unit + p % unit
    }

    /// Store one ggml super-block at (row `j`, super-block `b`): each part copied a unit at a
    /// time to where [`at`](Self::at) puts its bytes.
    fn put_block(&mut self, j: usize, b: usize, blk: &[u8]) {
        let r = self.rec();
        let base = self.at(j, b, 0, 0, 1) - j % GROUP;
        let (row, kind) = (j % GROUP, self.kind);
        let bytes = self.bytes_mut();
        let mut put = |part: usize, unit: usize, src: &[u8]| {
            for (u, c) in src.chunks_exact(unit).enumerate() {
                let o = base + part + u * GROUP * unit + row * unit;
                bytes[o..o + unit].copy_from_slice(c);
            }
        };
        match kind {
            KKind::Q4K => {
                put(r.d, 2, &blk[0..2]);
                put(r.dmin, 2, &blk[2..4]);
                put(r.sc, 4, &blk[4..4 + Q4K_SC]);
                put(r.ql, 4, &blk[16..16 + QL]);
            }
            _ => {
                let (ql, rest) = blk.split_at(128);
                let (qh, rest) = rest.split_at(64);
                let (scales, dd) = rest.split_at(16);
                let mut v = [0u8; QK_K];
                q6k_values(ql, qh, &mut v);
                let low: [u8; QL] = std::array::from_fn(|p| (v[p] & 0xF) | (v[p + 128] & 0xF) << 4);
                let high: [u8; QH] =
                    std::array::from_fn(|p| (0..4).fold(0u8, |h, i| h | (v[p + 64 * i] >> 4) << (2 * i)));
                put(r.d, 2, &dd[..2]);
                put(r.sc, 2, &scales[..Q6K_SC]);
                put(r.ql, 4, &low);
                put(r.qh, 4, &high);
            }
        }
    }

    /// The ggml super-block at (row `j`, super-block `b`), byte for byte as the file had it.
    fn get_block(&self, j: usize, b: usize, blk: &mut Vec<u8>) {
        let r = self.rec();
        let bytes = self.bytes();
        let get = |part: usize, p: usize, unit: usize| bytes[self.at(j, b, part, p, unit)];
        match self.kind {
            KKind::Q4K => {
                blk.extend((0..2).map(|p| get(r.d, p, 2)));
                blk.extend((0..2).map(|p| get(r.dmin, p, 2)));
                blk.extend((0..Q4K_SC).map(|p| get(r.sc, p, 4)));
                blk.extend((0..QL).map(|p| get(r.ql, p, 4)));
            }
            _ => {
                let mut v = [0u8; QK_K];
                for p in 0..QL {
                    let q = get(r.ql, p, 4);
                    v[p] = q & 0xF;
                    v[p + 128] = q >> 4;
                }
                for p in 0..QH {
                    let h = get(r.qh, p, 4);
                    for i in 0..4 {
                        v[p + 64 * i] |= ((h >> (2 * i)) & 3) << 4;
                    }
                }
                let mut ql = [0u8; 128];
                let mut qh = [0u8; 64];
                for half in 0..2 {
                    for l in 0..32 {
                        let at = |o: usize| v[128 * half + l + o];
                        ql[64 * half + l] = (at(0) & 0xF) | (at(64) & 0xF) << 4;
                        ql[64 * half + l + 32] = (at(32) & 0xF) | (at(96) & 0xF) << 4;
                        qh[32 * half + l] = at(0) >> 4 | (at(32) >> 4) << 2 | (at(64) >> 4) << 4 | (at(96) >> 4) << 6;
                    }
                }
                blk.extend_from_slice(&ql);
                blk.extend_from_slice(&qh);
                blk.extend((0..Q6K_SC).map(|p| get(r.sc, p, 2)));
                blk.extend((0..2).map(|p| get(r.d, p, 2)));
            }
        }
    }

    /// Weight row `j` as ggml super-blocks (the bytes of the file).
    pub fn row_bytes(&self, j: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.nb * self.kind.block_bytes());
        for b in 0..self.nb {
            self.get_block(j, b, &mut out);
        }
        out
    }

    /// The weight rows `ids`, in that order, as a new weight (super-blocks unchanged). Panics if
    /// an id is not below `n`.
    pub fn select_rows(&self, ids: &[u32]) -> Self {
        let mut w = Self::zeros(self.kind, ids.len(), self.k);
        let mut blk = Vec::with_capacity(self.kind.block_bytes());
        for (r, &j) in ids.iter().enumerate() {
            assert!((j as usize) < self.n, "select_rows: row {j} of {}", self.n);
            for b in 0..self.nb {
                blk.clear();
                self.get_block(j as usize, b, &mut blk);
                w.put_block(r, b, &blk);
            }
        }
        w
    }

    /// Checks of the SIMD tile: the tile starts a group and fits the matrix and `out`, and the
    /// activation rows are as long as the weights.
    fn check_tile(&self, a: &Acts, j0: usize, nw: usize, gi: usize, out: &[f32]) {
        let (i0, g) = a.groups[gi];
        assert!(
            j0.is_multiple_of(GROUP) && (1..=GROUP).contains(&nw) && j0 + nw <= self.n && out.len() >= nw * g,
            "tile out of range"
        );
        for (i, x) in a.rows[i0..i0 + g].iter().enumerate() {
            assert!(
                x.d.len() >= self.nb
                    && x.qs.len() >= self.nb * QK_K
                    && x.bsums.len() >= self.nb * 16
                    && (self.kind != KKind::Q4K || a.pairs.len() >= (i0 + i + 1) * self.nb * 4),
                "activation row shorter than the weights"
            );
        }
    }
}

/// Activation rows prepared for the tile: the Q8_K rows, their groups, and for Q4_K per row and
/// super-block the four pairs of 32-value quant sums `(s[2u], s[2u + 1])` as i16 pairs (the
/// operand of the min products; the sums are at most 32 · 127 in magnitude).
pub(crate) struct Acts<'a> {
    pub(crate) rows: std::borrow::Cow<'a, [Q8KRow]>,
    pub(crate) groups: Vec<(usize, usize)>,
    /// `[row][sb][4]`, Q4_K only.
    pairs: Vec<i32>,
}

impl<'a> Acts<'a> {
    pub(crate) fn new(kind: KKind, rows: std::borrow::Cow<'a, [Q8KRow]>, groups: Vec<(usize, usize)>) -> Self {
        let pairs = if kind == KKind::Q4K {
            rows.iter()
                .flat_map(|x| {
                    x.bsums.chunks_exact(4).map(|b| {
                        let s0 = (b[0] as i32 + b[1] as i32) as i16;
                        let s1 = (b[2] as i32 + b[3] as i32) as i16;
                        (s0 as u16 as u32 | (s1 as u16 as u32) << 16) as i32
                    })
                })
                .collect()
        } else {
            Vec::new()
        };
        Self { rows, groups, pairs }
    }
}

/// `vpshufb` control taking bytes `a` and `b` of each dword to the low bytes of its two 16-bit
/// halves (zero-extended): the i16 pairs of the Q4_K min products, and with `a == b` a scale
/// byte duplicated for the AVX2 tiles' `madd`. The 16-byte pattern repeats, so the VNNI tiles
/// read all 64 bytes and the AVX2 tiles the first 32.
#[cfg(target_arch = "x86_64")]
const fn pair_ctrl(a: usize, b: usize) -> [u8; 64] {
    let mut c = [0x80u8; 64];
    let mut i = 0;
    while i < 16 {
        let p = (i % 4) * 4;
        c[4 * i] = (p + a) as u8;
        c[4 * i + 2] = (p + b) as u8;
        i += 1;
    }
    c
}
#[cfg(target_arch = "x86_64")]
static PAIR01: [u8; 64] = pair_ctrl(0, 1);
#[cfg(target_arch = "x86_64")]
static PAIR23: [u8; 64] = pair_ctrl(2, 3);

/// A wide tile kernel: `(weights, activations, j0, nw, row group, out)`, as
/// [`vnni::tile_dispatch`] and [`avx2::tile_dispatch`].
///
/// # Safety
/// The CPU has the kernel's instruction set.
#[cfg(target_arch = "x86_64")]
pub(crate) type TileFn = unsafe fn(&KWide, &Acts, usize, usize, usize, &mut [f32]);

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};

#[cfg(target_arch = "x86_64")]
/// Records ahead of the one being read that a tile prefetches (the stream runs on into the
/// next tile's group): 4.6-6.8 KB.
const PREFETCH_RECORDS: usize = 2;

#[cfg(target_arch = "x86_64")]
/// The record `PREFETCH_RECORDS` after record `base`, to prefetch while reading `base`
/// (null for none). A prefetch past the end is harmless.
#[inline(always)]
fn ahead(w: &KWide, base: usize, on: bool) -> *const u8 {
    if on {
        (w.data.as_ptr() as *const u8).wrapping_add((base + PREFETCH_RECORDS) * w.rec().size)
    } else {
        std::ptr::null()
    }
}

#[cfg(target_arch = "x86_64")]
/// Prefetch part `part` of `parts` of the `size`-byte record at `p` (the lines spread over
/// the sub-blocks, so the misses are in flight a few at a time). Nothing for null.
#[inline(always)]
unsafe fn prefetch_part(p: *const u8, size: usize, part: usize, parts: usize) {
    if p.is_null() {
        return;
    }
    let lines = size / 64;
    for l in part * lines / parts..(part + 1) * lines / parts {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64 * l) as *const i8);
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod vnni {
    //! The AVX-512 VNNI tiles: 16 weight rows (one group) × `R` activation rows. Per (group,
    //! super-block) the 16 rows' scales are decoded once; per activation row and sub-block, the
    //! 16 sub-block sums come from `vpdpbusd` (one unit of the 16 rows against 4 activation bytes
    //! broadcast) and are scaled by the 16 rows' sub-block scales with one `vpmulld`; the float
    //! steps then run once per (16 rows, activation row, super-block).

    use super::*;
    use std::arch::x86_64::*;

    /// `acc + a[2i] b[2i] + a[2i+1] b[2i+1]` per i32 lane (exact).
    #[inline]
    #[target_feature(enable = "avx512f,avx512vnni")]
    unsafe fn dpwssd(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
        _mm512_dpwssd_epi32(acc, a, b)
    }

    /// Write a tile's results, row-major `out[r * nw + l]`: lane `l` of `acc[r]` is weight row
    /// `l` of the tile. `out` holds at least `R * nw` values (`check_tile`).
    #[inline(always)]
    unsafe fn store<const R: usize>(acc: &[__m512; R], nw: usize, out: &mut [f32]) {
        debug_assert!(out.len() >= R * nw && nw <= GROUP);
        let mask = ((1u32 << nw) - 1) as __mmask16;
        for (r, acc) in acc.iter().enumerate() {
            _mm512_mask_storeu_ps(out.as_mut_ptr().add(r * nw), mask, *acc);
        }
    }

    /// f16 `d` of the 16 rows at `p` → f32.
    #[inline]
    #[target_feature(enable = "avx512f,f16c")]
    unsafe fn scales_f32(p: *const u8) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }

    /// Q4_K tile: the group of weight rows from `j0` × the `R` activation rows from `i0`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn q4k<const R: usize>(w: &KWide, a: &Acts, j0: usize, nw: usize, i0: usize, pf: bool, out: &mut [f32]) {
        let nb = w.nb;
        let r = &Q4K_REC;
        let xq: [*const i8; R] = std::array::from_fn(|i| a.rows[i0 + i].qs.as_ptr());
        let xd: [*const f32; R] = std::array::from_fn(|i| a.rows[i0 + i].d.as_ptr());
        let xp: [*const i32; R] = std::array::from_fn(|i| a.pairs.as_ptr().add((i0 + i) * nb * 4));
        let nib = _mm512_set1_epi8(0x0F);
        let (k1, k2, k3) = (
            _mm512_set1_epi32(0x3f3f_3f3f),
            _mm512_set1_epi32(0x0f0f_0f0f),
            _mm512_set1_epi32(0x0303_0303),
        );
        let byte = _mm512_set1_epi32(0xFF);
        let p01 = _mm512_loadu_si512(PAIR01.as_ptr() as *const __m512i);
        let p23 = _mm512_loadu_si512(PAIR23.as_ptr() as *const __m512i);
        let mut sum = [_mm512_setzero_ps(); R];
        let mut summs = [_mm512_setzero_ps(); R];
        for b in 0..nb {
            let base = (j0 / GROUP) * nb + b;
            let next = ahead(w, base, pf);
            let rec = (w.data.as_ptr() as *const u8).add(base * r.size);
            let dw = scales_f32(rec.add(r.d));
            let dm = scales_f32(rec.add(r.dmin));
            // ggml's get_scale_min_k4 on the 16 rows' packed bytes (its kmask1..3 steps).
            let ps = rec.add(r.sc);
            let u0 = _mm512_loadu_si512(ps as *const __m512i);
            let u1 = _mm512_loadu_si512(ps.add(64) as *const __m512i);
            let u2 = _mm512_loadu_si512(ps.add(128) as *const __m512i);
            let hi0 = _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(u0), k3));
            let hi1 = _mm512_slli_epi32::<4>(_mm512_and_si512(_mm512_srli_epi32::<6>(u1), k3));
            let sc_lo = _mm512_and_si512(u0, k1);
            let sc_hi = _mm512_or_si512(_mm512_and_si512(u2, k2), hi0);
            let m_lo = _mm512_and_si512(u1, k1);
            let m_hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32::<4>(u2), k2), hi1);
            let pq = rec.add(r.ql);
            let mut sumi = [_mm512_setzero_si512(); R];
            for s in 0..8 {
                prefetch_part(next, r.size, s, 8);
                let (c, high) = (s / 2, s % 2 == 1);
                let src = if s < 4 { sc_lo } else { sc_hi };
                let scv = _mm512_and_si512(_mm512_srlv_epi32(src, _mm512_set1_epi32(8 * (s as i32 % 4))), byte);
                let mut wv = [_mm512_setzero_si512(); 8];
                for (t, v) in wv.iter_mut().enumerate() {
                    let raw = _mm512_load_si512(pq.add(64 * (8 * c + t)) as *const __m512i);
                    *v = if high {
                        _mm512_and_si512(_mm512_srli_epi16::<4>(raw), nib)
                    } else {
                        _mm512_and_si512(raw, nib)
                    };
                }
                for (i, sumi) in sumi.iter_mut().enumerate() {
                    let x = xq[i].add(b * QK_K + 64 * c + if high { 32 } else { 0 }) as *const i32;
                    let mut s0 = _mm512_setzero_si512();
                    let mut s1 = _mm512_setzero_si512();
                    for t in (0..8).step_by(2) {
                        s0 = _mm512_dpbusd_epi32(s0, wv[t], _mm512_set1_epi32(x.add(t).read_unaligned()));
                        s1 = _mm512_dpbusd_epi32(s1, wv[t + 1], _mm512_set1_epi32(x.add(t + 1).read_unaligned()));
                    }
                    *sumi = _mm512_add_epi32(*sumi, _mm512_mullo_epi32(_mm512_add_epi32(s0, s1), scv));
                }
            }
            let mp = [
                _mm512_shuffle_epi8(m_lo, p01),
                _mm512_shuffle_epi8(m_lo, p23),
                _mm512_shuffle_epi8(m_hi, p01),
                _mm512_shuffle_epi8(m_hi, p23),
            ];
            for i in 0..R {
                let p = xp[i].add(b * 4);
                let mut summ = _mm512_setzero_si512();
                for (u, mp) in mp.iter().enumerate() {
                    summ = dpwssd(summ, *mp, _mm512_set1_epi32(*p.add(u)));
                }
                let dx = _mm512_set1_ps(*xd[i].add(b));
                sum[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[i]), _mm512_mul_ps(dw, dx), sum[i]);
                summs[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(summ), _mm512_mul_ps(dm, dx), summs[i]);
            }
        }
        let mut y = [_mm512_setzero_ps(); R];
        for i in 0..R {
            y[i] = _mm512_sub_ps(sum[i], summs[i]);
        }
        store::<R>(&y, nw, out);
    }

    /// The four unsigned 6-bit weight units `t0 .. t0 + 4` of quarter `Q` (values `64 Q + 4 t ..`)
    /// of the 16 rows: low 4 bits from `ql` unit `16 (Q % 2) + t` (its low nibbles for `Q < 2`,
    /// high ones above), high 2 bits from `qh` unit `t` (bits `2Q`, `2Q + 1` of each byte).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn q6k_units<const Q: u32>(pql: *const u8, pqh: *const u8, t0: usize) -> [__m512i; 4] {
        let nib = _mm512_set1_epi8(0x0F);
        let two = _mm512_set1_epi8(0x30);
        let mut out = [_mm512_setzero_si512(); 4];
        for (i, o) in out.iter_mut().enumerate() {
            let t = t0 + i;
            let ql = _mm512_load_si512(pql.add(64 * (16 * (Q as usize % 2) + t)) as *const __m512i);
            let qh = _mm512_load_si512(pqh.add(64 * t) as *const __m512i);
            let lo = if Q < 2 { ql } else { _mm512_srli_epi16::<4>(ql) };
            let hb = match Q {
                0 => _mm512_slli_epi16::<4>(qh),
                1 => _mm512_slli_epi16::<2>(qh),
                2 => qh,
                _ => _mm512_srli_epi16::<2>(qh),
            };
            // (lo & 0x0F) | (hb & 0x30)
            *o = _mm512_ternarylogic_epi32::<0xF8>(_mm512_and_si512(hb, two), lo, nib);
        }
        out
    }

    /// The 16 rows' scales of sub-blocks `2u` and `2u + 1`, sign-extended: as i16 pairs (the
    /// offset product's operand) and as the two i32 vectors.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn q6k_scales(psc: *const u8, u: usize) -> (__m512i, __m512i, __m512i) {
        let pair = _mm512_cvtepi8_epi16(_mm256_loadu_si256(psc.add(32 * u) as *const __m256i));
        let a = _mm512_srai_epi32::<16>(_mm512_slli_epi32::<16>(pair));
        let b = _mm512_srai_epi32::<16>(pair);
        (pair, a, b)
    }

    /// One quarter of a Q6_K super-block (sub-blocks `4Q .. 4Q + 4`) for the `R` rows.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn q6k_quarter<const Q: u32, const R: usize>(
        pql: *const u8,
        pqh: *const u8,
        psc: *const u8,
        next: *const u8,
        x: &[*const i8; R],
        sumi: &mut [__m512i; R],
    ) {
        for half in 0..2 {
            prefetch_part(next, Q6K_REC.size, 2 * Q as usize + half, 8);
            let u = 2 * Q as usize + half;
            let (_, sa, sb) = q6k_scales(psc, u);
            for (e, scv) in [sa, sb].into_iter().enumerate() {
                let s = 2 * u + e;
                let t0 = 4 * (s % 4);
                let wv = q6k_units::<Q>(pql, pqh, t0);
                for (i, sumi) in sumi.iter_mut().enumerate() {
                    let xp = x[i].add(64 * Q as usize + 4 * t0) as *const i32;
                    let s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[0], _mm512_set1_epi32(xp.read_unaligned()));
                    let s1 = _mm512_dpbusd_epi32(
                        _mm512_setzero_si512(),
                        wv[1],
                        _mm512_set1_epi32(xp.add(1).read_unaligned()),
                    );
                    let s0 = _mm512_dpbusd_epi32(s0, wv[2], _mm512_set1_epi32(xp.add(2).read_unaligned()));
                    let s1 = _mm512_dpbusd_epi32(s1, wv[3], _mm512_set1_epi32(xp.add(3).read_unaligned()));
                    *sumi = _mm512_add_epi32(*sumi, _mm512_mullo_epi32(_mm512_add_epi32(s0, s1), scv));
                }
            }
        }
    }

    /// Q6_K tile: the group of weight rows from `j0` × the `R` activation rows from `i0`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn q6k<const R: usize>(w: &KWide, a: &Acts, j0: usize, nw: usize, i0: usize, pf: bool, out: &mut [f32]) {
        let nb = w.nb;
        let r = &Q6K_REC;
        let xd: [*const f32; R] = std::array::from_fn(|i| a.rows[i0 + i].d.as_ptr());
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..nb {
            let base = (j0 / GROUP) * nb + b;
            let next = ahead(w, base, pf);
            let xq: [*const i8; R] = std::array::from_fn(|i| a.rows[i0 + i].qs.as_ptr().add(b * QK_K));
            let xb: [*const i32; R] = std::array::from_fn(|i| a.rows[i0 + i].bsums.as_ptr().add(b * 16) as *const i32);
            let rec = (w.data.as_ptr() as *const u8).add(base * r.size);
            let dw = scales_f32(rec.add(r.d));
            let (psc, pql, pqh) = (rec.add(r.sc), rec.add(r.ql), rec.add(r.qh));
            let mut sumi = [_mm512_setzero_si512(); R];
            q6k_quarter::<0, R>(pql, pqh, psc, next, &xq, &mut sumi);
            q6k_quarter::<1, R>(pql, pqh, psc, next, &xq, &mut sumi);
            q6k_quarter::<2, R>(pql, pqh, psc, next, &xq, &mut sumi);
            q6k_quarter::<3, R>(pql, pqh, psc, next, &xq, &mut sumi);
            let mut pairs = [_mm512_setzero_si512(); 8];
            for (u, p) in pairs.iter_mut().enumerate() {
                *p = q6k_scales(psc, u).0;
            }
            for i in 0..R {
                // The offset of the unsigned encoding: -32 Σ_s sc[s] bsums[s].
                let mut corr = _mm512_setzero_si512();
                for (u, pair) in pairs.iter().enumerate() {
                    corr = dpwssd(corr, *pair, _mm512_set1_epi32(xb[i].add(u).read_unaligned()));
                }
                let isum = _mm512_sub_epi32(sumi[i], _mm512_slli_epi32::<5>(corr));
                let dx = _mm512_set1_ps(*xd[i].add(b));
                acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(isum), dw), dx, acc[i]);
            }
        }
        store::<R>(&acc, nw, out);
    }

    /// One tile of the product: the weight rows `j0 .. j0 + nw` (`j0` a multiple of [`GROUP`],
    /// `nw` ≤ 16) × the rows of group `gi`, `out[r * nw + w]`. With one row group each tile
    /// prefetches ahead in the record stream (running on into the next tile's); with several,
    /// the first row group's tile of each panel does, and the others read it from cache.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(crate) unsafe fn tile_dispatch(w: &KWide, a: &Acts, j0: usize, nw: usize, gi: usize, out: &mut [f32]) {
        w.check_tile(a, j0, nw, gi, out);
        let (i0, g) = a.groups[gi];
        let pf = gi == 0;
        by_rows!(g, |R| if w.kind == KKind::Q6K {
            q6k::<R>(w, a, j0, nw, i0, pf, out)
        } else {
            q4k::<R>(w, a, j0, nw, i0, pf, out)
        })
    }
}

/// The AVX2 tiles (CPUs without AVX-512 VNNI): the same layout read as two halves of 8 rows, one
/// 256-bit register per half. Per (half, super-block) the 8 rows' scales are decoded once; per
/// activation row and sub-block the 8 sums of products come from `maddubs` against 4 activation
/// bytes broadcast, added in 16 bits, then multiplied by the rows' sub-block scales with `madd`
/// (one per Q4_K sub-block, two per Q6_K sub-block: one per 16-bit half-sum); the float steps
/// run once per (8 rows, activation row, super-block).
///
/// **Exactness of the 16-bit sums.** `maddubs` adds two products of an unsigned weight and a
/// signed activation byte (|q_x| ≤ 128). Q4_K: weights ≤ 15, so a pair is at most 3,840 in
/// magnitude and a sub-block's 8 pairs per lane at most 30,720 < 2^15. Q6_K: weights ≤ 63, a pair
/// at most 16,128, two pairs 32,256 < 2^15; a 16-value sub-block is summed as two such 16-bit
/// sums, each `madd`ed with the scale into i32. Every integer total is exact, so the float
/// steps see the same values as the VNNI tiles and the portable reference.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// Activation rows per tile. On the Qwen2.5-Coder-1.5B (2-vCPU AMD EPYC, AVX2 only) 8 rows
    /// measured as fast as 4 and 6 up to 6 rows and faster for 7-9 (a verify of k = 6..8); the
    /// Q4_K tile runs them in passes of `PASS` so that their 16-bit sums stay in registers
    /// (`docs/perf.md`).
    pub const TILE_ROWS: usize = 8;

    /// Rows per half of a group (the 8 i32 lanes of a 256-bit register).
    const HALF: usize = GROUP / 2;

    /// `vpshufb` control taking the i16 at bytes `a, a + 1` of each dword to both of its halves.
    const fn dup_word(a: usize) -> [u8; 32] {
        let mut c = [0u8; 32];
        let mut i = 0;
        while i < 8 {
            let p = (i % 4) * 4;
            c[4 * i] = (p + a) as u8;
            c[4 * i + 1] = (p + a + 1) as u8;
            c[4 * i + 2] = (p + a) as u8;
            c[4 * i + 3] = (p + a + 1) as u8;
            i += 1;
        }
        c
    }
    /// `vpshufb` controls taking byte `a` of each dword to both 16-bit halves of the dword,
    /// zero-extended: a per-row scale byte as the i16 pair `madd` multiplies by (the first 32
    /// bytes of [`pair_ctrl`]`(a, a)`).
    static DUP_BYTE: [[u8; 64]; 4] = [pair_ctrl(0, 0), pair_ctrl(1, 1), pair_ctrl(2, 2), pair_ctrl(3, 3)];
    static DUP_WORD: [[u8; 32]; 2] = [dup_word(0), dup_word(2)];

    /// The first 32 bytes of a control table as a 256-bit register.
    #[inline(always)]
    unsafe fn ctrl(c: &[u8]) -> __m256i {
        debug_assert!(c.len() >= 32);
        _mm256_loadu_si256(c.as_ptr() as *const __m256i)
    }

    /// 4 activation bytes at `p` broadcast to every dword.
    #[inline(always)]
    unsafe fn bcast(p: *const i8) -> __m256i {
        _mm256_set1_epi32((p as *const i32).read_unaligned())
    }

    /// f16 values of the 8 rows at `p` → f32.
    #[inline(always)]
    unsafe fn f16x8(p: *const u8) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }

    /// Write the two halves' results, row-major `out[r * nw + l]` (`nw` ≤ 16 lanes of each row).
    #[inline(always)]
    unsafe fn store<const R: usize>(y: &[[__m256; R]; 2], nw: usize, out: &mut [f32]) {
        debug_assert!(out.len() >= R * nw && nw <= GROUP);
        let mut tmp = [0f32; GROUP];
        for r in 0..R {
            _mm256_storeu_ps(tmp.as_mut_ptr(), y[0][r]);
            _mm256_storeu_ps(tmp.as_mut_ptr().add(HALF), y[1][r]);
            out[r * nw..(r + 1) * nw].copy_from_slice(&tmp[..nw]);
        }
    }

    /// Activation rows per pass over a Q4_K sub-block pair's weights. A pass keeps two 16-bit
    /// sums per row in registers, beside the unpacked weights and the broadcast activations: 4
    /// rows fit AVX2's 16 registers, 8 spilled their sums to the stack on every `maddubs`.
    /// Rows past the first pass unpack the weights again (4 instructions per unit against 24
    /// for 4 rows' products).
    const PASS: usize = 4;

    /// The sums of Q4_K sub-blocks `2c` (low nibbles, units at `pc`) and `2c + 1` (high
    /// nibbles) for the activation rows `first .. first + n` (`n` ≤ [`PASS`]), scaled by the 8
    /// rows' sub-block scales `s` and added to `sumi`. `xo` is the activations' offset of the
    /// pair (`QK_K b + 64 c`).
    #[inline(always)]
    unsafe fn q4k_pass<const R: usize>(
        pc: *const u8,
        xq: &[*const i8; R],
        xo: usize,
        first: usize,
        n: usize,
        s: [__m256i; 2],
        sumi: &mut [__m256i; R],
    ) {
        let nib = _mm256_set1_epi8(0x0F);
        let mut al = [_mm256_setzero_si256(); PASS];
        let mut ah = [_mm256_setzero_si256(); PASS];
        for t in 0..8 {
            let raw = _mm256_load_si256(pc.add(64 * t) as *const __m256i);
            let lo = _mm256_and_si256(raw, nib);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), nib);
            for p in 0..n {
                let x = xq[first + p].add(xo + 4 * t);
                al[p] = _mm256_add_epi16(al[p], _mm256_maddubs_epi16(lo, bcast(x)));
                ah[p] = _mm256_add_epi16(ah[p], _mm256_maddubs_epi16(hi, bcast(x.add(32))));
            }
        }
        for p in 0..n {
            let v = _mm256_add_epi32(_mm256_madd_epi16(al[p], s[0]), _mm256_madd_epi16(ah[p], s[1]));
            sumi[first + p] = _mm256_add_epi32(sumi[first + p], v);
        }
    }

    /// Q4_K tile: the group of weight rows from `j0` × the `R` activation rows from `i0`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4k<const R: usize>(w: &KWide, a: &Acts, j0: usize, nw: usize, i0: usize, pf: bool, out: &mut [f32]) {
        let nb = w.nb;
        let r = &Q4K_REC;
        let xq: [*const i8; R] = std::array::from_fn(|i| a.rows[i0 + i].qs.as_ptr());
        let xd: [*const f32; R] = std::array::from_fn(|i| a.rows[i0 + i].d.as_ptr());
        let xp: [*const i32; R] = std::array::from_fn(|i| a.pairs.as_ptr().add((i0 + i) * nb * 4));
        let (k1, k2, k3) = (
            _mm256_set1_epi32(0x3f3f_3f3f),
            _mm256_set1_epi32(0x0f0f_0f0f),
            _mm256_set1_epi32(0x0303_0303),
        );
        let p01 = _mm256_loadu_si256(PAIR01.as_ptr() as *const __m256i);
        let p23 = _mm256_loadu_si256(PAIR23.as_ptr() as *const __m256i);
        let halves = if nw > HALF { 2 } else { 1 };
        let mut sum = [[_mm256_setzero_ps(); R]; 2];
        let mut summs = [[_mm256_setzero_ps(); R]; 2];
        for b in 0..nb {
            let base = (j0 / GROUP) * nb + b;
            let next = ahead(w, base, pf);
            let rec = (w.data.as_ptr() as *const u8).add(base * r.size);
            for h in 0..halves {
                let off = 4 * HALF * h;
                let dw = f16x8(rec.add(r.d + 2 * HALF * h));
                let dm = f16x8(rec.add(r.dmin + 2 * HALF * h));
                // ggml's get_scale_min_k4 on the 8 rows' packed bytes (its kmask1..3 steps).
                let ps = rec.add(r.sc + off);
                let u0 = _mm256_load_si256(ps as *const __m256i);
                let u1 = _mm256_load_si256(ps.add(64) as *const __m256i);
                let u2 = _mm256_load_si256(ps.add(128) as *const __m256i);
                let hi0 = _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srli_epi32::<6>(u0), k3));
                let hi1 = _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srli_epi32::<6>(u1), k3));
                let sc_lo = _mm256_and_si256(u0, k1);
                let sc_hi = _mm256_or_si256(_mm256_and_si256(u2, k2), hi0);
                let m_lo = _mm256_and_si256(u1, k1);
                let m_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32::<4>(u2), k2), hi1);
                let pq = rec.add(r.ql + off);
                let mut sumi = [_mm256_setzero_si256(); R];
                for c in 0..4 {
                    if h == 0 {
                        prefetch_part(next, r.size, c, 4);
                    }
                    // Sub-blocks 2c (low nibbles) and 2c + 1 (high nibbles).
                    let src = if c < 2 { sc_lo } else { sc_hi };
                    let s = [
                        _mm256_shuffle_epi8(src, ctrl(&DUP_BYTE[(2 * c) % 4])),
                        _mm256_shuffle_epi8(src, ctrl(&DUP_BYTE[(2 * c + 1) % 4])),
                    ];
                    let pc = pq.add(64 * 8 * c);
                    let xo = b * QK_K + 64 * c;
                    q4k_pass::<R>(pc, &xq, xo, 0, R.min(PASS), s, &mut sumi);
                    if R > PASS {
                        q4k_pass::<R>(pc, &xq, xo, PASS, R - PASS, s, &mut sumi);
                    }
                }
                let mp = [
                    _mm256_shuffle_epi8(m_lo, p01),
                    _mm256_shuffle_epi8(m_lo, p23),
                    _mm256_shuffle_epi8(m_hi, p01),
                    _mm256_shuffle_epi8(m_hi, p23),
                ];
                for i in 0..R {
                    let p = xp[i].add(b * 4);
                    let mut summ = _mm256_setzero_si256();
                    for (u, mp) in mp.iter().enumerate() {
                        summ = _mm256_add_epi32(summ, _mm256_madd_epi16(*mp, _mm256_set1_epi32(*p.add(u))));
                    }
                    let dx = _mm256_set1_ps(*xd[i].add(b));
                    sum[h][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[i]), _mm256_mul_ps(dw, dx), sum[h][i]);
                    summs[h][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(summ), _mm256_mul_ps(dm, dx), summs[h][i]);
                }
            }
        }
        let mut y = [[_mm256_setzero_ps(); R]; 2];
        for h in 0..2 {
            for i in 0..R {
                y[h][i] = _mm256_sub_ps(sum[h][i], summs[h][i]);
            }
        }
        store::<R>(&y, nw, out);
    }

    /// The four unsigned 6-bit weight units `t0 .. t0 + 4` of quarter `Q` (values `64 Q + 4 t ..`)
    /// of the 8 rows of a half (the VNNI `q6k_units` on 256 bits).
    #[inline(always)]
    unsafe fn q6k_units<const Q: u32>(pql: *const u8, pqh: *const u8, t0: usize) -> [__m256i; 4] {
        let nib = _mm256_set1_epi8(0x0F);
        let two = _mm256_set1_epi8(0x30);
        let mut out = [_mm256_setzero_si256(); 4];
        for (i, o) in out.iter_mut().enumerate() {
            let t = t0 + i;
            let ql = _mm256_load_si256(pql.add(64 * (16 * (Q as usize % 2) + t)) as *const __m256i);
            let qh = _mm256_load_si256(pqh.add(64 * t) as *const __m256i);
            let lo = if Q < 2 { ql } else { _mm256_srli_epi16::<4>(ql) };
            let hb = match Q {
                0 => _mm256_slli_epi16::<4>(qh),
                1 => _mm256_slli_epi16::<2>(qh),
                2 => qh,
                _ => _mm256_srli_epi16::<2>(qh),
            };
            *o = _mm256_or_si256(_mm256_and_si256(lo, nib), _mm256_and_si256(hb, two));
        }
        out
    }

    /// The 8 rows' signed scales of sub-blocks `2u`, `2u + 1` as i16 pairs (one dword a row).
    #[inline(always)]
    unsafe fn q6k_pair(psc: *const u8, u: usize) -> __m256i {
        _mm256_cvtepi8_epi16(_mm_loadu_si128(psc.add(32 * u) as *const __m128i))
    }

    /// One quarter of a Q6_K super-block (sub-blocks `4Q .. 4Q + 4`) for the `R` rows of a half.
    #[inline(always)]
    unsafe fn q6k_quarter<const Q: u32, const R: usize>(
        pql: *const u8,
        pqh: *const u8,
        psc: *const u8,
        x: &[*const i8; R],
        sumi: &mut [__m256i; R],
    ) {
        for half in 0..2 {
            let u = 2 * Q as usize + half;
            let pair = q6k_pair(psc, u);
            for (e, dup) in DUP_WORD.iter().enumerate() {
                let scv = _mm256_shuffle_epi8(pair, ctrl(dup));
                let s = 2 * u + e;
                let t0 = 4 * (s % 4);
                let wv = q6k_units::<Q>(pql, pqh, t0);
                for (i, sumi) in sumi.iter_mut().enumerate() {
                    let xp = x[i].add(64 * Q as usize + 4 * t0);
                    let s0 = _mm256_add_epi16(
                        _mm256_maddubs_epi16(wv[0], bcast(xp)),
                        _mm256_maddubs_epi16(wv[1], bcast(xp.add(4))),
                    );
                    let s1 = _mm256_add_epi16(
                        _mm256_maddubs_epi16(wv[2], bcast(xp.add(8))),
                        _mm256_maddubs_epi16(wv[3], bcast(xp.add(12))),
                    );
                    let v = _mm256_add_epi32(_mm256_madd_epi16(s0, scv), _mm256_madd_epi16(s1, scv));
                    *sumi = _mm256_add_epi32(*sumi, v);
                }
            }
        }
    }

    /// Q6_K tile: the group of weight rows from `j0` × the `R` activation rows from `i0`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q6k<const R: usize>(w: &KWide, a: &Acts, j0: usize, nw: usize, i0: usize, pf: bool, out: &mut [f32]) {
        let nb = w.nb;
        let r = &Q6K_REC;
        let xd: [*const f32; R] = std::array::from_fn(|i| a.rows[i0 + i].d.as_ptr());
        let halves = if nw > HALF { 2 } else { 1 };
        let mut acc = [[_mm256_setzero_ps(); R]; 2];
        for b in 0..nb {
            let xq: [*const i8; R] = std::array::from_fn(|i| a.rows[i0 + i].qs.as_ptr().add(b * QK_K));
            let xb: [*const i32; R] = std::array::from_fn(|i| a.rows[i0 + i].bsums.as_ptr().add(b * 16) as *const i32);
            let base = (j0 / GROUP) * nb + b;
            let next = ahead(w, base, pf);
            let rec = (w.data.as_ptr() as *const u8).add(base * r.size);
            for (h, acc) in acc.iter_mut().enumerate().take(halves) {
                let off = 4 * HALF * h;
                let dw = f16x8(rec.add(r.d + 2 * HALF * h));
                let (psc, pql, pqh) = (rec.add(r.sc + 2 * HALF * h), rec.add(r.ql + off), rec.add(r.qh + off));
                let next = if h == 0 { next } else { std::ptr::null() };
                let mut sumi = [_mm256_setzero_si256(); R];
                prefetch_part(next, r.size, 0, 4);
                q6k_quarter::<0, R>(pql, pqh, psc, &xq, &mut sumi);
                prefetch_part(next, r.size, 1, 4);
                q6k_quarter::<1, R>(pql, pqh, psc, &xq, &mut sumi);
                prefetch_part(next, r.size, 2, 4);
                q6k_quarter::<2, R>(pql, pqh, psc, &xq, &mut sumi);
                prefetch_part(next, r.size, 3, 4);
                q6k_quarter::<3, R>(pql, pqh, psc, &xq, &mut sumi);
                let mut pairs = [_mm256_setzero_si256(); 8];
                for (u, p) in pairs.iter_mut().enumerate() {
                    *p = q6k_pair(psc, u);
                }
                for i in 0..R {
                    // The offset of the unsigned encoding: -32 Σ_s sc[s] bsums[s].
                    let mut corr = _mm256_setzero_si256();
                    for (u, pair) in pairs.iter().enumerate() {
                        let bs = _mm256_set1_epi32(xb[i].add(u).read_unaligned());
                        corr = _mm256_add_epi32(corr, _mm256_madd_epi16(*pair, bs));
                    }
                    let isum = _mm256_sub_epi32(sumi[i], _mm256_slli_epi32::<5>(corr));
                    let dx = _mm256_set1_ps(*xd[i].add(b));
                    acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(isum), dw), dx, acc[i]);
                }
            }
        }
        store::<R>(&acc, nw, out);
    }

    /// One tile of the product: the weight rows `j0 .. j0 + nw` (`j0` a multiple of [`GROUP`],
    /// `nw` ≤ 16) × the rows of group `gi` (at most [`TILE_ROWS`]), `out[r * nw + w]`. The
    /// first row group's tiles prefetch ahead in the record stream, as the VNNI tiles do.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn tile_dispatch(w: &KWide, a: &Acts, j0: usize, nw: usize, gi: usize, out: &mut [f32]) {
        w.check_tile(a, j0, nw, gi, out);
        let (i0, g) = a.groups[gi];
        let pf = gi == 0;
        by_rows!(g, |R| if w.kind == KKind::Q6K {
            q6k::<R>(w, a, j0, nw, i0, pf, out)
        } else {
            q4k::<R>(w, a, j0, nw, i0, pf, out)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::kquants::{quantize_row_q8k, vec_dot_portable, KWeight};
    use super::super::KernelPath;
    use super::*;

    /// Random super-blocks with finite f16 scales; every fourth block has extreme bytes.
    fn blocks(kind: KKind, n: usize, k: usize, seed: u64) -> Vec<u8> {
        let bb = kind.block_bytes();
        let mut st = seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1;
        let mut next = move || {
            st ^= st << 13;
            st ^= st >> 7;
            st ^= st << 17;
            st
        };
        let mut data = Vec::new();
        for blk in 0..n * k / QK_K {
            let start = data.len();
            data.extend((0..bb).map(|_| match blk % 4 {
                0 => 0xFF,
                _ => next() as u8,
            }));
            let f = |v: f32| half::f16::from_f32(v).to_bits().to_le_bytes();
            let d = f((next() % 2000) as f32 / 1000.0 - 1.0);
            let b = &mut data[start..start + bb];
            if kind == KKind::Q4K {
                b[0..2].copy_from_slice(&d);
                b[2..4].copy_from_slice(&f((next() % 2000) as f32 / 1000.0 - 1.0));
            } else {
                b[208..210].copy_from_slice(&d);
            }
        }
        data
    }

    /// `x W^T` (`x` `[m, k]`) by the tiles of `isa` called one by one, groups as serving forms
    /// them; `None` where this CPU lacks `isa`.
    fn wide_product(w: &KWide, x: &[f32], m: usize, isa: super::super::WideIsa) -> Option<Vec<f32>> {
        use super::super::WideIsa;
        #[cfg(target_arch = "x86_64")]
        {
            let have = match isa {
                WideIsa::Vnni => super::super::has_avx512_vnni(),
                WideIsa::Avx2 => super::super::qmatmul::has_avx2(),
            };
            if !have {
                return None;
            }
            let (n, k) = w.dims();
            let rows: Vec<_> = x.chunks_exact(k).map(quantize_row_q8k).collect();
            let max = if isa == WideIsa::Vnni {
                TILE_ROWS
            } else {
                avx2::TILE_ROWS
            };
            let groups = super::super::row_groups(m, max);
            let acts = Acts::new(w.kind, std::borrow::Cow::Owned(rows), groups.clone());
            let tile: TileFn = match isa {
                WideIsa::Vnni => vnni::tile_dispatch,
                WideIsa::Avx2 => avx2::tile_dispatch,
            };
            let job = super::super::TileJob::new(n, k, m, groups, GROUP, move |j0, nw, (gi, _, _), out| {
                // SAFETY: the instruction set was detected above; the tile is checked inside.
                unsafe { tile(w, &acts, j0, nw, gi, out) }
            });
            let y = super::super::run_jobs(&[job]).pop()?;
            Some(y)
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (w, x, m, isa);
            None
        }
    }

    #[test]
    fn layout_round_trips_the_file_blocks() {
        for kind in [KKind::Q4K, KKind::Q6K] {
            let (n, k) = (37, 3 * QK_K);
            let data = blocks(kind, n, k, 3);
            let w = KWide::from_ggml(kind, n, k, &data);
            let rb = k / QK_K * kind.block_bytes();
            for j in 0..n {
                assert_eq!(w.row_bytes(j), &data[j * rb..(j + 1) * rb], "{kind:?} row {j}");
            }
            let ids = [36u32, 0, 17, 17, 5];
            let sel = w.select_rows(&ids);
            for (r, &j) in ids.iter().enumerate() {
                assert_eq!(sel.row_bytes(r), w.row_bytes(j as usize), "{kind:?} selected row {r}");
            }
        }
    }

    /// The wide tiles (one and several groups, every row count, several row groups) against the
    /// portable reference bit for bit, and rows against one-row products.
    #[test]
    fn tiles_match_portable_bitwise() {
        for kind in [KKind::Q4K, KKind::Q6K] {
            // 53 rows: a last group of 5 (one half); 61: of 13 (both halves, a partial store).
            for n in [53usize, 61] {
                let k = 2 * QK_K;
                let data = blocks(kind, n, k, 9);
                let w = KWeight::from_blocks(kind, n, k, data.clone());
                let rb = k / QK_K * kind.block_bytes();
                for m in [1usize, 2, 3, 5, 6, 7, 8, 9, 13, 17] {
                    let mut st = 77u64 + m as u64;
                    let x: Vec<f32> = (0..m * k)
                        .map(|i| {
                            st ^= st << 13;
                            st ^= st >> 7;
                            st ^= st << 17;
                            let v = (st >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
                            if i % 97 == 0 {
                                (v * 1e4) as f32
                            } else {
                                v as f32
                            }
                        })
                        .collect();
                    let got = w.matmul_on(&x, m, KernelPath::Best);
                    // Each instruction set's tiles on this CPU, called directly (an AVX-512 machine
                    // checks the AVX2 tiles too).
                    let wide = KWide::from_ggml(kind, n, k, &data);
                    for isa in [super::super::WideIsa::Vnni, super::super::WideIsa::Avx2] {
                        let Some(y) = wide_product(&wide, &x, m, isa) else {
                            continue;
                        };
                        for (e, (a, b)) in y.iter().zip(&got).enumerate() {
                            assert_eq!(a.to_bits(), b.to_bits(), "{kind:?} {isa:?} n={n} m={m} element {e}");
                        }
                    }
                    for i in 0..m {
                        let q = quantize_row_q8k(&x[i * k..(i + 1) * k]);
                        for j in 0..n {
                            let bytes = &data[j * rb..(j + 1) * rb];
                            let want = vec_dot_portable(w.row(bytes), &q);
                            assert_eq!(
                                got[i * n + j].to_bits(),
                                want.to_bits(),
                                "{kind:?} n={n} m={m} [{i},{j}]"
                            );
                        }
                        let one = w.matmul_on(&x[i * k..(i + 1) * k], 1, KernelPath::Best);
                        assert_eq!(
                            one.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                            got[i * n..(i + 1) * n].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                            "{kind:?} m={m} row {i} vs one row"
                        );
                    }
                }
            }
        }
    }
}
