//! Batch-invariant quantized matrix multiplication for ggml's K-quant super-block types Q2_K,
//! Q3_K, Q4_K, Q5_K and Q6_K (256 weights per super-block).
//!
//! `y = x W^T` with `W` (`[n, k]`, `k` a multiple of 256) stored as ggml super-blocks
//! (`ggml/src/ggml-common.h`: `block_q2_K` .. `block_q6_K`, kept byte for byte as the GGUF file
//! has them) and each activation row quantized to Q8_K as ggml's `quantize_row_q8_K_ref`
//! (`ggml/src/ggml-quants.c`; the x86 CPU backend uses the reference directly): per 256 values
//! `iscale = -127 / max` where `max` is the first value of largest magnitude, `q = min(127,
//! nearest_int(iscale * x))` (round half to even), `d = 1 / iscale` (f32), and `bsums` = the i16
//! sums of each 16 quants.
//!
//! Arithmetic per output element is what llama.cpp's x86 CPU backend computes for one row
//! (decode), except Q6_K (below): ggml's AVX2 dot products `ggml_vec_dot_q{2,3,5,6}_K_q8_K`
//! (`ggml/src/ggml-cpu/arch/x86/quants.c`), and for Q4_K, which llama.cpp repacks into 8-row
//! interleaved blocks on every AVX2 CPU, its `ggml_gemv_q4_K_8x8_q8_K`
//! (`ggml/src/ggml-cpu/arch/x86/repack.cpp`). Per super-block,
//! the weights are expanded to 256 small integers `w` and 16 integer scales `sc` (one per 16
//! values), and eight exact i32 lane sums are formed: lane `l` holds
//! `sum over the eight 32-value chunks c of sc[2c + l/4] * sum_{t<4} w[32c+4l+t] * q8[32c+4l+t]`
//! (the `maddubs` + `madd(scales)` pattern of all five AVX2 kernels). Then, per type:
//!
//! - Q6_K: lane `l` minus `32 * (bsums[2l] sc[2l] + bsums[2l+1] sc[2l+1])` (the weights are
//!   expanded unsigned, 0..63); serving then takes the exact total `isum` of the lanes and
//!   `acc = fma(f32(isum) * d_w, d_x, acc)`, one float chain per output: llama.cpp's tiled
//!   batch kernel (`ggml/src/ggml-cpu/tiled/`, what it runs for 8 rows or more), not its
//!   `vec_dot`'s `acc = fma(d, lanes, acc)` over eight lanes, which kept the multi-row tile
//!   slow. The eight-lane form stays for llama.cpp's products of fewer than 8 rows
//!   ([`with_llamacpp_batches`]).
//! - Q4_K (repacked gemv): `sum = fma(f32(Σ lanes), d_w d_x, sum)` and `summs =
//!   fma(f32(Σ_u m[u] s[u]), dmin_w d_x, summs)` with `s[u]` the sum of the 32 quants of
//!   sub-block `u` (both integer totals exact); the result is `sum - summs`.
//! - Q5_K: `summs = fma(dmin, sum_u m[u] s[u], summs)` (scalar; GCC contracts ggml's
//!   `summs += dmin * ...` into an FMA under its default `-ffp-contract=fast`), then
//!   `acc = fma(d, lanes, acc)`; the result is `hsum_float_8(acc) + summs`.
//! - Q2_K: `acc = fma(dmin, lanes_m, acc)` with `lanes_m[l] = m[2l] bsums[2l] + m[2l+1]
//!   bsums[2l+1]`, then `acc = fma(d, lanes, acc)`.
//! - Q3_K: weights expanded signed (-4..3), `acc = fma(d, lanes, acc)`.
//!
//! where `d = d_x * d_w` and `dmin = -d_x * dmin_w` per super-block, and the final reduction of
//! `acc` is ggml's `hsum_float_8` order.
//!
//! **Paths.** The portable path ([`vec_dot_portable`]) is the reference. The AVX2 path is ggml's
//! loop with the weights decoded in registers once per super-block and the integer products
//! repeated for up to [`MAX_ROWS`] activation rows ([`vec_dot_rows`]). Where AVX-512 BW is
//! available, Q4_K/Q5_K/Q6_K take two 32-value chunks per 512-bit `maddubs`/`madd` and fold the
//! 16 lanes back to ggml's 8 with exact i32 adds. The lane sums are exact integers and every path
//! performs the same float operations in the same order, so all paths agree bitwise (tested
//! here). Checked once against ggml's own functions (`quantize_row_q8_K_ref` and the five AVX2
//! `ggml_vec_dot_q*_K_q8_K`, ggml built with GCC 12 at `-O2 -mavx2 -mfma` and at
//! `-O3 -march=native`) on random and on real Qwen2.5 Q4_K/Q6_K tensors: bitwise equal; Q4_K
//! and Q6_K are also tested in CI against recorded llama.cpp products.
//!
//! Where AVX-512 VNNI or AVX2 is available, Q4_K and Q6_K weights are stored interleaved by 16
//! rows ([`KWide`], the same bytes rearranged) and every product of them, one row or many, runs
//! on its tiles: 16 output features per 512-bit register (VNNI) or 8 per 256-bit register
//! (AVX2), the float steps once per (register of features, activation row, super-block).
//! Products of 2 or more rows of Q5_K run on tiles of two weight rows × up to [`vnni_rows`]
//! activation rows (`avx2_impl::tile`): `vpdpbusd` sums of 4 products packed in pairs into one
//! `vpdpwssd` per two chunks (25% fewer multiply instructions than `maddubs` + `madd`), the
//! decoding of each super-block shared by all the rows, and the float steps of the two weight
//! rows in one 512-bit register. One-row Q5_K products (decode) stay on the row kernels, which
//! stream the weights from memory faster.
//! `SPECULA_KERNELS=avx2` forces the row kernels, `SPECULA_KERNELS=portable` the reference.
//!
//! **llama.cpp's batch arithmetic.** llama.cpp computes a multi-row product differently: Q4_K
//! rows in groups of four through the repacked gemm (one FMA per 64 values instead of 256), Q6_K
//! products of 8 rows or more through its tiled kernel (`ggml/src/ggml-cpu/tiled/`: per
//! super-block `acc = fma(f32(isum) * d_w, d_x, acc)`). [`with_llamacpp_batches`] reproduces
//! both, for the reference comparison only; both were checked bit for bit against llama.cpp's
//! own products (`matches_llamacpp_recorded_products`, recorded by
//! `scripts/llamacpp_kquant_dump.cpp`).
//!
//! **Batch invariance.** Every output element is computed by the same function of one weight row
//! and one activation row, whatever the number of rows `m`: the multi-row micro-kernel only
//! shares the decoding of each weight super-block between activation rows, and which group a row
//! lands in (a function of `m`) does not change its arithmetic.

use candle_core::quantized::{GgmlDType, QTensor};
use half::f16;

use super::kwide::KWide;
use super::qmatmul::{hsum8, nearest_int};
use super::{fixed_groups, row_groups};

/// Weights per super-block.
pub const QK_K: usize = 256;

/// The K-quant super-block types this kernel handles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KKind {
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
}

impl KKind {
    /// The kind for a candle/ggml dtype, if this kernel supports it.
    pub fn from_ggml(dt: GgmlDType) -> Option<Self> {
        Some(match dt {
            GgmlDType::Q2K => KKind::Q2K,
            GgmlDType::Q3K => KKind::Q3K,
            GgmlDType::Q4K => KKind::Q4K,
            GgmlDType::Q5K => KKind::Q5K,
            GgmlDType::Q6K => KKind::Q6K,
            _ => return None,
        })
    }

    /// Bytes per super-block (`sizeof(block_qN_K)`).
    pub fn block_bytes(&self) -> usize {
        match self {
            KKind::Q2K => 84,
            KKind::Q3K => 110,
            KKind::Q4K => 144,
            KKind::Q5K => 176,
            KKind::Q6K => 210,
        }
    }

    /// Are the expanded weights signed (Q3_K: -4..3) rather than unsigned?
    fn signed(&self) -> bool {
        *self == KKind::Q3K
    }
}

/// One activation row quantized to Q8_K (`block_q8_K`): per super-block an f32 scale `d`
/// (`[k / 256]`), 256 signed quants (`qs`, `[k]`, each in -127..=127) and the i16 sums of each 16
/// quants (`bsums`, `[k / 16]`).
#[derive(Debug, Clone)]
pub struct Q8KRow {
    pub d: Vec<f32>,
    pub qs: Vec<i8>,
    pub bsums: Vec<i16>,
}

/// Quantize one row of `k` floats (`k` a multiple of 256) as ggml's `quantize_row_q8_K_ref`.
/// A block of zeros gets `d = 0` and zero quants and sums.
pub fn quantize_row_q8k(x: &[f32]) -> Q8KRow {
    let nb = x.len() / QK_K;
    let mut d = vec![0f32; nb];
    let mut qs = vec![0i8; nb * QK_K];
    let mut bsums = vec![0i16; nb * (QK_K / 16)];
    #[cfg(target_arch = "x86_64")]
    let (avx512, avx2) = (has_avx512(), super::qmatmul::has_avx2());
    for (b, chunk) in x.chunks_exact(QK_K).enumerate() {
        let q = &mut qs[b * QK_K..(b + 1) * QK_K];
        let sums = &mut bsums[b * 16..(b + 1) * 16];
        #[cfg(target_arch = "x86_64")]
        if avx512 {
            // SAFETY: AVX-512 F was detected at run time; the slices hold one super-block.
            d[b] = unsafe { quantize_block_q8k_avx512(chunk, q, sums) };
            continue;
        } else if avx2 {
            // SAFETY: AVX2 was detected at run time; the slices hold one super-block.
            d[b] = unsafe { quantize_block_q8k_avx2(chunk, q, sums) };
            continue;
        }
        d[b] = quantize_block_q8k(chunk, q, sums);
    }
    Q8KRow { d, qs, bsums }
}

/// One super-block of [`quantize_row_q8k`]: quants into `q`, sums into `bsums`, returns `d`
/// (0 for a block of zeros, whose quants and sums stay 0).
fn quantize_block_q8k(chunk: &[f32], q: &mut [i8], bsums: &mut [i16]) -> f32 {
    let mut max = 0f32;
    let mut amax = 0f32;
    for &v in chunk {
        let a = v.abs();
        if a > amax {
            amax = a;
            max = v;
        }
    }
    if amax == 0.0 {
        return 0.0;
    }
    let iscale = -127.0f32 / max;
    for (o, &v) in q.iter_mut().zip(chunk) {
        *o = nearest_int(iscale * v).min(127) as i8;
    }
    for (g, s) in bsums.iter_mut().enumerate() {
        *s = q[g * 16..(g + 1) * 16].iter().map(|&v| v as i32).sum::<i32>() as i16;
    }
    1.0 / iscale
}

/// [`quantize_block_q8k`] 16 lanes at a time, the same bytes for every input: the largest
/// magnitude is exact in any order and skips NaN lanes as the scalar scan does, `max` is the
/// first value (in index order) that has it, as the scalar scan's strict `>` picks; the rounding
/// is the scalar's `nearest_int` lane by lane, then `min(127)` and the low byte (`vpmovdb`, as
/// `as i8`); one register is one 16-quant sum.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn quantize_block_q8k_avx512(chunk: &[f32], q: &mut [i8], bsums: &mut [i16]) -> f32 {
    use super::qmatmul::quant_avx512::{max_abs, nearest_int};
    use std::arch::x86_64::*;
    assert!(chunk.len() == QK_K && q.len() == QK_K && bsums.len() == QK_K / 16);
    let mut v = [_mm512_setzero_ps(); 16];
    let mut m = _mm512_setzero_ps();
    for (t, r) in v.iter_mut().enumerate() {
        *r = _mm512_loadu_ps(chunk.as_ptr().add(16 * t));
        m = max_abs(m, *r);
    }
    let amax = _mm512_reduce_max_ps(m);
    if amax == 0.0 {
        return 0.0;
    }
    let target = _mm512_set1_ps(amax);
    let mut max = 0f32;
    for (t, r) in v.iter().enumerate() {
        let hit = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(_mm512_abs_ps(*r), target);
        if hit != 0 {
            max = chunk[16 * t + hit.trailing_zeros() as usize];
            break;
        }
    }
    let iscale = -127.0f32 / max;
    let sv = _mm512_set1_ps(iscale);
    let top = _mm512_set1_epi32(127);
    for (t, r) in v.iter().enumerate() {
        let qi = _mm512_min_epi32(nearest_int(_mm512_mul_ps(sv, *r)), top);
        _mm_storeu_si128(q.as_mut_ptr().add(16 * t) as *mut __m128i, _mm512_cvtepi32_epi8(qi));
        bsums[t] = _mm512_reduce_add_epi32(qi) as i16;
    }
    1.0 / iscale
}

/// [`quantize_block_q8k`] 8 lanes at a time, the same bytes for every input: the largest
/// magnitude is exact in any order, `max` is the first value in index order that has it, the
/// rounding is the scalar's `nearest_int` lane by lane, then `min(127)` and the low byte (`as
/// i8`); two registers are one 16-quant sum.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_block_q8k_avx2(chunk: &[f32], q: &mut [i8], bsums: &mut [i16]) -> f32 {
    use super::qmatmul::quant_avx2::{abs, hmax, hsum_i32, max_abs, nearest_int, store_bytes};
    use std::arch::x86_64::*;
    assert!(chunk.len() == QK_K && q.len() == QK_K && bsums.len() == QK_K / 16);
    let at = |t: usize| _mm256_loadu_ps(chunk.as_ptr().add(8 * t));
    let mut m = _mm256_setzero_ps();
    for t in 0..QK_K / 8 {
        m = max_abs(m, at(t));
    }
    let amax = hmax(m);
    if amax == 0.0 {
        return 0.0;
    }
    let target = _mm256_set1_ps(amax);
    let mut max = 0f32;
    for t in 0..QK_K / 8 {
        let hit = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(abs(at(t)), target));
        if hit != 0 {
            max = chunk[8 * t + hit.trailing_zeros() as usize];
            break;
        }
    }
    let iscale = -127.0f32 / max;
    let sv = _mm256_set1_ps(iscale);
    let top = _mm256_set1_epi32(127);
    for u in 0..QK_K / 32 {
        let qi: [__m256i; 4] =
            std::array::from_fn(|i| _mm256_min_epi32(nearest_int(_mm256_mul_ps(sv, at(4 * u + i))), top));
        store_bytes(q.as_mut_ptr().add(32 * u), qi);
        bsums[2 * u] = hsum_i32(_mm256_add_epi32(qi[0], qi[1])) as i16;
        bsums[2 * u + 1] = hsum_i32(_mm256_add_epi32(qi[2], qi[3])) as i16;
    }
    1.0 / iscale
}

/// A weight matrix `[n, k]` in one of the [`KKind`] formats, in owned memory: the ggml
/// super-blocks as stored, row-major (`n * k / 256` blocks of [`KKind::block_bytes`] bytes), or,
/// for Q4_K and Q6_K where the wide kernels run (AVX-512 VNNI or AVX2), the same bytes
/// interleaved by 16 rows ([`KWide`]).
#[derive(Debug, Clone)]
pub struct KWeight {
    kind: KKind,
    n: usize,
    k: usize,
    /// The super-blocks row-major; empty when `wide` holds the weight.
    data: Vec<u8>,
    wide: Option<KWide>,
    /// With `wide`: the super-blocks row-major, rebuilt on first use by a path that reads the
    /// file's layout (llama.cpp's batch arithmetic for the reference comparison, the forced
    /// AVX2 / portable paths): that doubles the weight's memory, outside serving only.
    file_rows: std::sync::OnceLock<Vec<u8>>,
}

impl KWeight {
    /// Take a candle quantized tensor of shape `[n, k]`; `None` if its type is not a K-quant or
    /// `k` is not a multiple of 256.
    pub fn from_qtensor(t: &QTensor) -> candle_core::Result<Option<Self>> {
        let Some(kind) = KKind::from_ggml(t.dtype()) else {
            return Ok(None);
        };
        let (n, k) = t.shape().dims2()?;
        if !k.is_multiple_of(QK_K) {
            return Ok(None);
        }
        let data = t.data()?;
        let want = n * (k / QK_K) * kind.block_bytes();
        if data.len() != want {
            candle_core::bail!("quantized tensor holds {} bytes, expected {want}", data.len());
        }
        Ok(Some(Self::from_blocks(kind, n, k, data.into_owned())))
    }

    /// From the ggml super-blocks of a `[n, k]` weight, row-major. Q4_K and Q6_K take the
    /// interleaved layout where the wide kernels run them (AVX-512 VNNI or AVX2, and
    /// `SPECULA_KERNELS` not forcing another path: [`super::wide_isa`]). Panics if `data` is not
    /// `n * k / 256` blocks.
    pub(crate) fn from_blocks(kind: KKind, n: usize, k: usize, data: Vec<u8>) -> Self {
        assert_eq!(data.len(), n * (k / QK_K) * kind.block_bytes(), "super-block bytes");
        if KWide::supports(kind) && super::wide_isa().is_some() {
            let wide = KWide::from_ggml(kind, n, k, &data);
            return Self {
                kind,
                n,
                k,
                data: Vec::new(),
                wide: Some(wide),
                file_rows: Default::default(),
            };
        }
        Self {
            kind,
            n,
            k,
            data,
            wide: None,
            file_rows: Default::default(),
        }
    }

    pub fn kind(&self) -> KKind {
        self.kind
    }

    /// The weight rows `ids`, in that order, as a new `[ids.len(), k]` weight (super-blocks
    /// copied unchanged: each output is bitwise what the full product gives at that row).
    /// Panics if an id is not below `n`.
    pub fn select_rows(&self, ids: &[u32]) -> Self {
        if let Some(w) = &self.wide {
            return Self {
                kind: self.kind,
                n: ids.len(),
                k: self.k,
                data: Vec::new(),
                wide: Some(w.select_rows(ids)),
                file_rows: Default::default(),
            };
        }
        let rb = self.k / QK_K * self.kind.block_bytes();
        Self {
            kind: self.kind,
            n: ids.len(),
            k: self.k,
            data: ids
                .iter()
                .flat_map(|&j| &self.data[j as usize * rb..][..rb])
                .copied()
                .collect(),
            wide: None,
            file_rows: Default::default(),
        }
    }

    /// `(n, k)`: output features, input features.
    pub fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// The super-blocks of weight row `j`, as in the file (borrowed, or rebuilt from the
    /// interleaved layout).
    pub fn row_bytes(&self, j: usize) -> &[u8] {
        let rb = self.k / QK_K * self.kind.block_bytes();
        let data = match &self.wide {
            Some(w) => self
                .file_rows
                .get_or_init(|| (0..self.n).flat_map(|j| w.row_bytes(j)).collect()),
            None => &self.data,
        };
        &data[j * rb..(j + 1) * rb]
    }

    /// A row of this weight's kind over `bytes` (from [`row_bytes`](Self::row_bytes)).
    pub fn row<'a>(&self, bytes: &'a [u8]) -> KRow<'a> {
        KRow {
            kind: self.kind,
            data: bytes,
        }
    }

    /// `x`: `[m, k]` row-major f32 → `[m, n]` row-major f32. Row `i` of the result is bitwise
    /// the same whatever `m` is, and whichever [`KernelPath`](super::KernelPath) runs. Panics if
    /// `x` is not `m * k` long.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        self.matmul_on(x, m, super::kernel_path())
    }

    /// [`matmul`](Self::matmul) on the given path (falling back to what the CPU supports).
    pub(crate) fn matmul_on(&self, x: &[f32], m: usize, path: super::KernelPath) -> Vec<f32> {
        super::run_jobs(&[self.job_on(x, m, path)]).pop().unwrap_or_default()
    }

    /// The product with `x` (`[m, k]` row-major f32), ready to run with others in one parallel
    /// pass ([`super::run_jobs`]): the activation rows quantized here, on the calling thread,
    /// and the llama.cpp batch arithmetic ([`with_llamacpp_batches`]) as set on it. Panics if
    /// `x` is not `m * k` long.
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
        let rows: Vec<Q8KRow> = x.chunks_exact(self.k).map(quantize_row_q8k).collect();
        // The activation rows of a group as the kernels take them (a group has at most
        // `MAX_ROWS` rows).
        fn refs(rows: &[Q8KRow], i0: usize, g: usize) -> [&Q8KRow; MAX_ROWS] {
            std::array::from_fn(|r| &rows[i0 + r.min(g - 1)])
        }
        // Rows `..batch_rows` with the `batch` flag of the portable reference: Q6_K's tiled
        // arithmetic, which serving uses for every row; in llama.cpp's batch arithmetic (its
        // emulation only) Q4_K's repacked gemm for the rows in groups of four, and Q6_K's tiled
        // kernel from 8 rows (its `vec_dot` below).
        let emulate = LLAMACPP_BATCHES.get();
        let batch_rows = match self.kind {
            KKind::Q4K if emulate => m - m % 4,
            KKind::Q6K if emulate && m < 8 => 0,
            KKind::Q6K => m,
            _ => 0,
        };
        #[cfg(target_arch = "x86_64")]
        if let Some(wide) = &self.wide {
            if let (Some(isa), super::KernelPath::Best, false) = (super::wide_isa(), path, emulate) {
                let (max, tile): (usize, super::kwide::TileFn) = match isa {
                    super::WideIsa::Vnni => (super::kwide::TILE_ROWS, super::kwide::vnni::tile_dispatch),
                    super::WideIsa::Avx2 => (super::kwide::avx2::TILE_ROWS, super::kwide::avx2::tile_dispatch),
                };
                let groups = row_groups(m, max);
                let acts = super::kwide::Acts::new(self.kind, std::borrow::Cow::Owned(rows), groups.clone());
                return super::TileJob::new(
                    self.n,
                    self.k,
                    m,
                    groups,
                    super::kwide::GROUP,
                    move |j0, nw, (gi, _, _), out| {
                        // SAFETY: `wide_isa` detected the tile's instruction set at run time (AVX-512
                        // F/BW/VL/VNNI or AVX2, with FMA and F16C); the tile is checked inside.
                        unsafe { tile(wide, &acts, j0, nw, gi, out) }
                    },
                );
            }
        }
        #[cfg(target_arch = "x86_64")]
        if path == super::KernelPath::Best
            && batch_rows == 0
            && m > 1
            && super::has_avx512_vnni()
            && self.kind == KKind::Q5K
        {
            let groups = row_groups(m, vnni_rows(self.kind));
            let q8s = avx2_impl::pair_sums(&rows, self.k / QK_K);
            return super::TileJob::new(self.n, self.k, m, groups, 2, move |j0, nw, (_, i0, g), out| {
                let xs = refs(&rows, i0, g);
                // SAFETY: AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C were detected at run time
                // (`has_avx512_vnni`); ranges are checked inside.
                unsafe { avx2_impl::tile_dispatch(self, &xs[..g], &q8s[i0..i0 + g], j0, nw, out) }
            });
        }
        // Weight rows per call of the row kernels' tile (one call's set-up for several rows).
        const ROW_TILE: usize = 8;
        let groups = fixed_groups(m, MAX_ROWS);
        let avx2 = super::qmatmul::has_avx2() && path != super::KernelPath::Portable;
        let wide = avx2 && has_avx512();
        super::TileJob::new(self.n, self.k, m, groups, ROW_TILE, move |j0, nw, (_, i0, g), out| {
            let xs = refs(&rows, i0, g);
            // The group's rows in llama.cpp's batch arithmetic, then the rest.
            let cut = batch_rows.clamp(i0, i0 + g) - i0;
            let mut col = [0f32; MAX_ROWS];
            for w in 0..nw {
                let (o1, o2) = col[..g].split_at_mut(cut);
                let row = self.row(self.row_bytes(j0 + w));
                if cut > 0 {
                    vec_dot_rows_with(row, &xs[..cut], o1, avx2, wide, true);
                }
                if cut < g {
                    vec_dot_rows_with(row, &xs[cut..g], o2, avx2, wide, false);
                }
                for (r, &y) in col[..g].iter().enumerate() {
                    out[r * nw + w] = y;
                }
            }
        })
    }
}

thread_local! {
    /// See [`with_llamacpp_batches`].
    static LLAMACPP_BATCHES: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Run `f` with Q4_K and Q6_K products computed as llama.cpp's x86 CPU backend computes a batch
/// (`on`), or with the one arithmetic of serving (`!on`, the default), on this thread.
///
/// - Q4_K: llama.cpp repacks the weights into 8-row interleaved blocks on any AVX2 CPU
///   (`ggml/src/ggml-cpu/repack.cpp`, `q4_K_8x8_q8_K`) and multiplies a batch of `m` rows with two
///   kernels (`arch/x86/repack.cpp`): rows `0 .. m - m % 4` in groups of four with
///   `ggml_gemm_q4_K_8x8_q8_K`, which adds `isum * (d_w * d_x)` to its accumulator with one FMA
///   per 64 values, and the last `m % 4` rows with `ggml_gemv_q4_K_8x8_q8_K`, one FMA per 256.
/// - Q6_K: products of 8 rows or more take ggml's tiled kernel (`ggml/src/ggml-cpu/tiled/`), per
///   super-block `acc = fma(f32(isum) * d_w, d_x, acc)`; fewer rows take `vec_dot`.
///
/// A row's bits thus depend on the batch around it. Serving always uses the one-row arithmetic
/// (llama.cpp's decode arithmetic), so it is batch-invariant; this switch reproduces llama.cpp's
/// prefill for the reference comparison (`Engine::logits_as_llamacpp`). With it on, these
/// products run on the row kernels (the wide VNNI and AVX2 tiles are skipped).
pub fn with_llamacpp_batches<R>(on: bool, f: impl FnOnce() -> R) -> R {
    super::with_thread_local(&LLAMACPP_BATCHES, on, f)
}

/// AVX-512 F and BW available at run time, along with the AVX2 set (the 512-bit row kernels).
pub fn has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| {
            super::qmatmul::has_avx2()
                && std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512bw")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// One weight row: its super-blocks, as stored.
#[derive(Clone, Copy)]
pub struct KRow<'a> {
    kind: KKind,
    data: &'a [u8],
}

/// A weight super-block expanded for the integer products.
struct Unpacked {
    /// The 256 weight values, value `i` at index `i`: unsigned bytes, or `i8` for Q3_K.
    q: [u8; QK_K],
    /// The scale of each 16 values.
    sc: [i16; 16],
    /// Q2_K: the min of each 16 values; Q4_K/Q5_K: the min of each 32 values (first 8).
    mins: [i16; 16],
    /// Super-block scale and min scale (f16 → f32).
    d: f32,
    dmin: f32,
}

impl Unpacked {
    fn new() -> Self {
        Self {
            q: [0; QK_K],
            sc: [0; 16],
            mins: [0; 16],
            d: 0.0,
            dmin: 0.0,
        }
    }
}

#[inline(always)]
fn h2f(lo: u8, hi: u8) -> f32 {
    f16::from_bits(u16::from_le_bytes([lo, hi])).to_f32()
}

/// The 6-bit scales (bytes 0..8) and mins (bytes 8..16) of the eight 32-value sub-blocks of
/// Q4_K/Q5_K from their 12 packed bytes: ggml's `get_scale_min_k4`, done four at a time with
/// the 32-bit masks of its AVX2 kernels (`kmask1..3`).
#[inline(always)]
fn scales_mins_k4(s: &[u8]) -> [u8; 16] {
    const K1: u32 = 0x3f3f_3f3f;
    const K2: u32 = 0x0f0f_0f0f;
    const K3: u32 = 0x0303_0303;
    let s: &[u8; 12] = s.try_into().expect("12 scale bytes");
    let w = |i: usize| u32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
    let (u0, u1, u2) = (w(0), w(1), w(2));
    let out = [
        u0 & K1,
        (u2 & K2) | (((u0 >> 6) & K3) << 4),
        u1 & K1,
        ((u2 >> 4) & K2) | (((u1 >> 6) & K3) << 4),
    ];
    let mut b = [0u8; 16];
    for (c, v) in b.chunks_exact_mut(4).zip(out) {
        c.copy_from_slice(&v.to_le_bytes());
    }
    b
}

/// The sixteen signed 6-bit scales of Q3_K from their 12 packed bytes (low 4 bits: bytes 0..8,
/// low then high nibbles; high 2 bits: bytes 8..12), minus 32.
#[inline(always)]
fn scales_q3k(s: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        let low = if i < 8 { s[i] & 0xF } else { s[i - 8] >> 4 };
        let high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        *o = (low | (high << 4)) as i8 - 32;
    }
    out
}

/// Expand one super-block (`blk`: [`KKind::block_bytes`] bytes). Plain code, shared by both
/// paths (the compiler vectorizes it inside the AVX2 functions).
#[inline(always)]
fn unpack(kind: KKind, blk: &[u8], u: &mut Unpacked) {
    match kind {
        KKind::Q2K => {
            // scales[16] (low nibble scale, high nibble min), qs[64], d, dmin.
            let (scales, rest) = blk.split_at(16);
            let (qs, dd) = rest.split_at(64);
            for (i, &v) in scales.iter().enumerate() {
                u.sc[i] = (v & 0xF) as i16;
                u.mins[i] = (v >> 4) as i16;
            }
            for j in 0..2 {
                for k in 0..4 {
                    for l in 0..32 {
                        u.q[128 * j + 32 * k + l] = (qs[32 * j + l] >> (2 * k)) & 3;
                    }
                }
            }
            u.d = h2f(dd[0], dd[1]);
            u.dmin = h2f(dd[2], dd[3]);
        }
        KKind::Q3K => {
            // hmask[32], qs[64], scales[12] (6-bit, offset 32), d.
            let (hmask, rest) = blk.split_at(32);
            let (qs, rest) = rest.split_at(64);
            let (scales, dd) = rest.split_at(12);
            for (o, &v) in u.sc.iter_mut().zip(&scales_q3k(scales)) {
                *o = v as i16;
            }
            for j in 0..2 {
                for k in 0..4 {
                    let bit = 4 * j + k;
                    for l in 0..32 {
                        let low = (qs[32 * j + l] >> (2 * k)) & 3;
                        let sub = if (hmask[l] >> bit) & 1 != 0 { 0 } else { 4 };
                        u.q[128 * j + 32 * k + l] = low.wrapping_sub(sub);
                    }
                }
            }
            u.d = h2f(dd[0], dd[1]);
        }
        KKind::Q4K => {
            // d, dmin, scales[12], qs[128].
            let scales = &blk[4..16];
            let qs = &blk[16..144];
            let sm = scales_mins_k4(scales);
            for j in 0..8 {
                u.sc[2 * j] = sm[j] as i16;
                u.sc[2 * j + 1] = sm[j] as i16;
                u.mins[j] = sm[8 + j] as i16;
            }
            for j in 0..4 {
                for l in 0..32 {
                    let b = qs[32 * j + l];
                    u.q[64 * j + l] = b & 0xF;
                    u.q[64 * j + 32 + l] = b >> 4;
                }
            }
            u.d = h2f(blk[0], blk[1]);
            u.dmin = h2f(blk[2], blk[3]);
        }
        KKind::Q5K => {
            // d, dmin, scales[12], qh[32], qs[128].
            let scales = &blk[4..16];
            let qh = &blk[16..48];
            let qs = &blk[48..176];
            let sm = scales_mins_k4(scales);
            for j in 0..8 {
                u.sc[2 * j] = sm[j] as i16;
                u.sc[2 * j + 1] = sm[j] as i16;
                u.mins[j] = sm[8 + j] as i16;
            }
            for j in 0..4 {
                for l in 0..32 {
                    let b = qs[32 * j + l];
                    let h = qh[l];
                    u.q[64 * j + l] = (b & 0xF) | (((h >> (2 * j)) & 1) << 4);
                    u.q[64 * j + 32 + l] = (b >> 4) | (((h >> (2 * j + 1)) & 1) << 4);
                }
            }
            u.d = h2f(blk[0], blk[1]);
            u.dmin = h2f(blk[2], blk[3]);
        }
        KKind::Q6K => {
            // ql[128], qh[64], scales[16] (i8), d. Values kept unsigned (0..63).
            let (ql, rest) = blk.split_at(128);
            let (qh, rest) = rest.split_at(64);
            let (scales, dd) = rest.split_at(16);
            for (o, &v) in u.sc.iter_mut().zip(scales) {
                *o = v as i8 as i16;
            }
            q6k_values(ql, qh, &mut u.q);
            u.d = h2f(dd[0], dd[1]);
        }
    }
}

/// The 256 unsigned 6-bit values of a Q6_K super-block from ggml's `ql` (128 bytes) and `qh`
/// (64 bytes), value `i` at index `i` (`dequantize_row_q6_K`'s order).
#[inline(always)]
pub(crate) fn q6k_values(ql: &[u8], qh: &[u8], v: &mut [u8; QK_K]) {
    for j in 0..2 {
        let ql = &ql[64 * j..64 * j + 64];
        let qh = &qh[32 * j..32 * j + 32];
        let q = &mut v[128 * j..128 * j + 128];
        for l in 0..32 {
            let h = qh[l];
            q[l] = (ql[l] & 0xF) | ((h & 3) << 4);
            q[32 + l] = (ql[l + 32] & 0xF) | (((h >> 2) & 3) << 4);
            q[64 + l] = (ql[l] >> 4) | (((h >> 4) & 3) << 4);
            q[96 + l] = (ql[l + 32] >> 4) | (((h >> 6) & 3) << 4);
        }
    }
}

/// The float accumulators of one (weight row, activation row) product.
struct Acc {
    /// ggml's eight `acc` lanes (every type but Q4_K).
    acc: [f32; 8],
    /// Q4_K's one accumulator of `isum * (d_w * d_x)` per super-block.
    sum: f32,
    /// Q5_K's scalar min sum (added at the end); Q4_K's `isum_min * (dmin_w * d_x)` accumulator
    /// (subtracted at the end).
    summs: f32,
}

impl Acc {
    fn new() -> Self {
        Self {
            acc: [0.0; 8],
            sum: 0.0,
            summs: 0.0,
        }
    }

    /// The final reduction: ggml's `hsum_float_8` (plus Q5_K's min sum); Q4_K's repacked
    /// kernels store `sum - summs`; Q6_K in llama.cpp's tiled batch arithmetic (`batch`) `sum`.
    fn finish(&self, kind: KKind, batch: bool) -> f32 {
        match kind {
            KKind::Q4K => self.sum - self.summs,
            KKind::Q6K if batch => self.sum,
            KKind::Q5K => hsum8(&self.acc) + self.summs,
            _ => hsum8(&self.acc),
        }
    }
}

/// The per-type min / offset terms of one super-block, from the expanded weights and the Q8_K
/// block sums (`bs`, 16 values): updates `st` and `lanes` as ggml's AVX2 kernels do before the
/// main `acc = fma(d, lanes, acc)`. Integer parts are exact; shared by both paths.
#[inline(always)]
fn min_terms(kind: KKind, u: &Unpacked, bs: &[i16], yd: f32, lanes: &mut [i32; 8], st: &mut Acc) {
    let b = |i: usize| bs[i] as i32;
    let mn = |i: usize| u.mins[i] as i32;
    match kind {
        KKind::Q2K => {
            let dmin = -yd * u.dmin;
            for (l, a) in st.acc.iter_mut().enumerate() {
                let p = mn(2 * l) * b(2 * l) + mn(2 * l + 1) * b(2 * l + 1);
                *a = dmin.mul_add(p as f32, *a);
            }
        }
        KKind::Q4K => {
            let mut p = 0i32;
            for v in 0..4 {
                let s0 = b(4 * v) + b(4 * v + 1);
                let s1 = b(4 * v + 2) + b(4 * v + 3);
                p += mn(2 * v) * s0 + mn(2 * v + 1) * s1;
            }
            st.summs = (p as f32).mul_add(u.dmin * yd, st.summs);
        }
        KKind::Q5K => {
            let dmin = -yd * u.dmin;
            let mut p = [0i32; 4];
            for (v, pv) in p.iter_mut().enumerate() {
                let s0 = b(4 * v) + b(4 * v + 1);
                let s1 = b(4 * v + 2) + b(4 * v + 3);
                *pv = mn(2 * v) * s0 + mn(2 * v + 1) * s1;
            }
            let s = (p[0] + p[1]) + (p[2] + p[3]);
            st.summs = dmin.mul_add(s as f32, st.summs);
        }
        KKind::Q6K => {
            for (l, x) in lanes.iter_mut().enumerate() {
                let sc = |i: usize| u.sc[i] as i32;
                *x -= (b(2 * l) * sc(2 * l) + b(2 * l + 1) * sc(2 * l + 1)) << 5;
            }
        }
        KKind::Q3K => {}
    }
}

/// Portable: one super-block of one activation row (`q8`: 256 quants, `bs`: 16 sums, `yd`: scale).
/// `batch`: llama.cpp's batch arithmetic ([`with_llamacpp_batches`]): Q4_K's float steps per 64
/// values (its repacked gemm), Q6_K's tiled kernel.
#[inline(always)]
fn block_row_portable(kind: KKind, u: &Unpacked, q8: &[i8], bs: &[i16], yd: f32, st: &mut Acc, batch: bool) {
    if batch && kind == KKind::Q4K {
        let b = |i: usize| bs[i] as i32;
        for j in 0..4 {
            let mut isum = 0i32;
            for c in [2 * j, 2 * j + 1] {
                let dot: i32 = (32 * c..32 * c + 32).map(|i| u.q[i] as i32 * q8[i] as i32).sum();
                isum += u.sc[2 * c] as i32 * dot;
            }
            let m = u.mins[2 * j] as i32 * (b(4 * j) + b(4 * j + 1))
                + u.mins[2 * j + 1] as i32 * (b(4 * j + 2) + b(4 * j + 3));
            st.sum = (isum as f32).mul_add(u.d * yd, st.sum);
            st.summs = (m as f32).mul_add(u.dmin * yd, st.summs);
        }
        return;
    }
    let mut lanes = [0i32; 8];
    let signed = kind.signed();
    for c in 0..8 {
        for (l, lane) in lanes.iter_mut().enumerate() {
            let mut p = 0i32;
            for t in 0..4 {
                let i = 32 * c + 4 * l + t;
                let w = if signed { u.q[i] as i8 as i32 } else { u.q[i] as i32 };
                p += w * q8[i] as i32;
            }
            *lane += u.sc[2 * c + l / 4] as i32 * p;
        }
    }
    min_terms(kind, u, bs, yd, &mut lanes, st);
    if batch && kind == KKind::Q6K {
        let isum: i32 = lanes.iter().sum();
        st.sum = (isum as f32 * u.d).mul_add(yd, st.sum);
        return;
    }
    if kind == KKind::Q4K {
        let isum: i32 = lanes.iter().sum();
        st.sum = (isum as f32).mul_add(u.d * yd, st.sum);
        return;
    }
    let d = yd * u.d;
    for (a, &x) in st.acc.iter_mut().zip(&lanes) {
        *a = d.mul_add(x as f32, *a);
    }
}

/// The portable reference for one (weight row, activation row) product in serving's
/// arithmetic: ggml's one-row arithmetic, but for Q6_K its tiled batch kernel (one float chain).
pub fn vec_dot_portable(w: KRow<'_>, x: &Q8KRow) -> f32 {
    vec_dot_portable_with(w, x, w.kind == KKind::Q6K)
}

/// [`vec_dot_portable`]; `batch`: llama.cpp's batch arithmetic ([`with_llamacpp_batches`]).
fn vec_dot_portable_with(w: KRow<'_>, x: &Q8KRow, batch: bool) -> f32 {
    let bb = w.kind.block_bytes();
    let mut u = Unpacked::new();
    let mut st = Acc::new();
    for (b, blk) in w.data.chunks_exact(bb).enumerate() {
        unpack(w.kind, blk, &mut u);
        block_row_portable(
            w.kind,
            &u,
            &x.qs[b * QK_K..(b + 1) * QK_K],
            &x.bsums[b * 16..(b + 1) * 16],
            x.d[b],
            &mut st,
            batch,
        );
    }
    st.finish(w.kind, batch)
}

/// Largest group of activation rows one call of the micro-kernel takes.
pub const MAX_ROWS: usize = 8;

/// Activation rows per tile of the VNNI kernels (two weight rows × this many rows): the most
/// whose accumulators stay in the 32 vector registers, measured (Q6_K's wider weight decoding
/// leaves room for fewer).
pub fn vnni_rows(kind: KKind) -> usize {
    match kind {
        KKind::Q6K => 5,
        _ => 8,
    }
}

/// `out[r] = ` the product of weight row `w` with `xs[r]`, for 1..=[`MAX_ROWS`] rows at once
/// (the weights are decoded once for all of them); each value is bitwise
/// [`vec_dot_portable`]`(w, xs[r])`.
pub fn vec_dot_rows(w: KRow<'_>, xs: &[&Q8KRow], out: &mut [f32], avx2: bool) {
    vec_dot_rows_with(w, xs, out, avx2, avx2 && has_avx512(), w.kind == KKind::Q6K);
}

/// [`vec_dot_rows`] with the SIMD paths chosen: `avx2` (AVX2 + FMA + F16C, required by `wide`)
/// and `wide` (the 512-bit row kernels for Q4_K/Q5_K/Q6_K, AVX-512 BW). Every choice gives the
/// same bits. `batch`: llama.cpp's batch arithmetic ([`with_llamacpp_batches`]).
fn vec_dot_rows_with(w: KRow<'_>, xs: &[&Q8KRow], out: &mut [f32], avx2: bool, wide: bool, batch: bool) {
    assert!(
        xs.len() == out.len() && xs.len() <= MAX_ROWS,
        "vec_dot_rows: {} rows, {} outputs",
        xs.len(),
        out.len()
    );
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // SAFETY: AVX2, FMA and F16C were detected at run time (and AVX-512 F/BW when `wide`,
        // see `has_avx512`); the rows' lengths are checked inside.
        unsafe {
            match xs.len() {
                1 => avx2_impl::dot::<1>(w, xs, out, wide, batch),
                2 => avx2_impl::dot::<2>(w, xs, out, wide, batch),
                3 => avx2_impl::dot::<3>(w, xs, out, wide, batch),
                4 => avx2_impl::dot::<4>(w, xs, out, wide, batch),
                5 => avx2_impl::dot::<5>(w, xs, out, wide, batch),
                6 => avx2_impl::dot::<6>(w, xs, out, wide, batch),
                7 => avx2_impl::dot::<7>(w, xs, out, wide, batch),
                8 => avx2_impl::dot::<8>(w, xs, out, wide, batch),
                _ => {}
            }
        }
        return;
    }
    let _ = (avx2, wide);
    for (o, x) in out.iter_mut().zip(xs) {
        *o = vec_dot_portable_with(w, x, batch);
    }
}

/// Dot product of one weight row with one Q8_K activation row.
#[inline]
pub fn vec_dot(w: KRow<'_>, x: &Q8KRow, avx2: bool) -> f32 {
    let mut o = [0f32];
    vec_dot_rows(w, &[x], &mut o, avx2);
    o[0]
}

#[cfg(target_arch = "x86_64")]
mod avx2_impl {
    //! The AVX2 kernels: per type, ggml's `ggml_vec_dot_qN_K_q8_K` AVX2 loop with the weights
    //! decoded in registers once per super-block and the integer products repeated for `R`
    //! activation rows. Per row, the integer lanes and the float operations are those of
    //! [`block_row_portable`] (checked bitwise by the tests).

    use super::*;
    use crate::kernels::qmatmul::vnni_impl::f16_pair;
    use std::arch::x86_64::*;

    /// `_mm256_shuffle_epi8` controls: entry `c` broadcasts i16 element `2c` over the low 128
    /// bits and element `2c + 1` over the high 128 bits (ggml's `get_scale_shuffle_q3k`).
    static PAIR: [[u8; 32]; 4] = {
        let mut t = [[0u8; 32]; 4];
        let mut c = 0;
        while c < 4 {
            let mut i = 0;
            while i < 16 {
                t[c][i] = (4 * c + (i & 1)) as u8;
                t[c][16 + i] = (4 * c + 2 + (i & 1)) as u8;
                i += 1;
            }
            c += 1;
        }
        t
    };

    /// `_mm256_shuffle_epi8` controls: entry `c` broadcasts i16 element `c` over all 256 bits
    /// (ggml's `get_scale_shuffle_k4`; the source holds the same 8 scales in both halves).
    static K4: [[u8; 32]; 8] = {
        let mut t = [[0u8; 32]; 8];
        let mut c = 0;
        while c < 8 {
            let mut i = 0;
            while i < 32 {
                t[c][i] = (2 * c + (i & 1)) as u8;
                i += 1;
            }
            c += 1;
        }
        t
    };

    /// Bytes ahead of the super-block being read that the row kernels prefetch: a chunk's
    /// rows lie one after another, so this runs a few rows ahead (1.5B decode: 1 KiB 0.95x,
    /// 2 KiB 1.0, 4 KiB 1.04x, 8 KiB 0.97x; none 0.71x).
    const PREFETCH_BYTES: usize = 4096;

    /// Prefetch the `bb` bytes of the super-block [`PREFETCH_BYTES`] past `p` (a prefetch past
    /// the end of the matrix is harmless: it never faults).
    #[inline(always)]
    unsafe fn prefetch_ahead(p: *const u8, bb: usize) {
        for off in (0..bb).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_BYTES + off) as *const i8);
        }
    }

    /// f16 bits (little-endian bytes) → f32 with F16C (exact, like `half`).
    #[inline(always)]
    unsafe fn h2f(lo: u8, hi: u8) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(u16::from_le_bytes([lo, hi]) as i32)))
    }

    #[inline(always)]
    unsafe fn ld(p: *const u8) -> __m256i {
        _mm256_loadu_si256(p as *const __m256i)
    }

    #[inline(always)]
    unsafe fn ld128(p: *const u8) -> __m128i {
        _mm_loadu_si128(p as *const __m128i)
    }

    /// 16 i16 scales (element `i` = scale of values `16i..16i+15`) → the `madd` operand of each
    /// 32-value chunk `c`: scale `2c` in the low 128 bits, `2c + 1` in the high.
    #[inline(always)]
    unsafe fn pair_scales(sc16: __m256i) -> [__m256i; 8] {
        let lo = _mm256_permute2x128_si256::<0x00>(sc16, sc16);
        let hi = _mm256_permute2x128_si256::<0x11>(sc16, sc16);
        let mut out = [_mm256_setzero_si256(); 8];
        for (c, o) in out.iter_mut().enumerate() {
            let src = if c < 4 { lo } else { hi };
            *o = _mm256_shuffle_epi8(src, ld(PAIR[c % 4].as_ptr()));
        }
        out
    }

    /// The float accumulators of `R` rows: ggml's `acc` (8 lanes), Q4_K's scalar `sum` and the
    /// scalar `summs` (Q4_K's and Q5_K's min sums); the fields of [`Acc`].
    struct State<const R: usize> {
        acc: [__m256; R],
        sum: [f32; R],
        summs: [f32; R],
    }

    impl<const R: usize> State<R> {
        #[inline(always)]
        unsafe fn new() -> Self {
            Self {
                acc: [_mm256_setzero_ps(); R],
                sum: [0.0; R],
                summs: [0.0; R],
            }
        }

        #[inline(always)]
        unsafe fn finish(&self, kind: KKind, batch: bool, out: &mut [f32]) {
            for (r, o) in out.iter_mut().enumerate().take(R) {
                let mut a = Acc::new();
                _mm256_storeu_ps(a.acc.as_mut_ptr(), self.acc[r]);
                a.sum = self.sum[r];
                a.summs = self.summs[r];
                *o = a.finish(kind, batch);
            }
        }

        /// Q4_K's float steps of one super-block (ggml's repacked `gemv_q4_K_8x8_q8_K`): the
        /// exact totals of the 8 integer lanes `sumi` and of the 4 min products `prod`, each
        /// converted to f32 and added with one FMA.
        #[inline(always)]
        unsafe fn q4k_step(&mut self, r: usize, sumi: __m256i, prod: __m128i, d: f32, dmin: f32) {
            self.sum[r] = (hsum8_epi32(sumi) as f32).mul_add(d, self.sum[r]);
            self.summs[r] = (hsum4_epi32(prod) as f32).mul_add(dmin, self.summs[r]);
        }

        /// Q4_K's float steps of one super-block in ggml's repacked gemm arithmetic
        /// (`gemm_q4_K_8x8_q8_K`): one FMA per 64 values, `isums[j]` the exact integer total of
        /// values `64j .. 64j + 64`, lane `j` of `prod` their min products.
        #[inline(always)]
        unsafe fn q4k_sb_steps(&mut self, r: usize, isums: &[i32; 4], prod: __m128i, d: f32, dmin: f32) {
            let mut m = [0i32; 4];
            _mm_storeu_si128(m.as_mut_ptr() as *mut __m128i, prod);
            for j in 0..4 {
                self.sum[r] = (isums[j] as f32).mul_add(d, self.sum[r]);
                self.summs[r] = (m[j] as f32).mul_add(dmin, self.summs[r]);
            }
        }
    }

    /// The exact (wrapping) sum of eight i32 lanes.
    #[inline(always)]
    unsafe fn hsum8_epi32(v: __m256i) -> i32 {
        hsum4_epi32(_mm_add_epi32(
            _mm256_castsi256_si128(v),
            _mm256_extracti128_si256::<1>(v),
        ))
    }

    /// The exact (wrapping) sum of four i32 lanes.
    #[inline(always)]
    unsafe fn hsum4_epi32(v: __m128i) -> i32 {
        let t = _mm_add_epi32(v, _mm_shuffle_epi32::<0b01_00_11_10>(v));
        let t = _mm_add_epi32(t, _mm_shuffle_epi32::<0b10_11_00_01>(t));
        _mm_cvtsi128_si32(t)
    }

    /// The Q8_K quants of row `x`, super-block `b`, from value `off`.
    #[inline(always)]
    unsafe fn q8(x: &Q8KRow, b: usize, off: usize) -> __m256i {
        ld(x.qs.as_ptr().add(b * QK_K + off) as *const u8)
    }

    #[inline(always)]
    unsafe fn bsums(x: &Q8KRow, b: usize) -> __m256i {
        ld(x.bsums.as_ptr().add(b * 16) as *const u8)
    }

    /// Unsigned weights `wv` (one 32-value chunk) times the quants `y`, pairs scaled by `s`.
    #[inline(always)]
    unsafe fn chunk(wv: __m256i, y: __m256i, s: __m256i) -> __m256i {
        _mm256_madd_epi16(s, _mm256_maddubs_epi16(wv, y))
    }

    /// `out[r]` = weight row `w` (`k` = 256 × blocks) times `xs[r]`, for `R` rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot<const R: usize>(w: KRow<'_>, xs: &[&Q8KRow], out: &mut [f32], wide: bool, batch: bool) {
        let Ok(x) = <[&Q8KRow; R]>::try_from(xs) else {
            return;
        };
        let nb = w.data.len() / w.kind.block_bytes();
        for xr in x {
            assert!(
                xr.d.len() >= nb && xr.qs.len() >= nb * QK_K && xr.bsums.len() >= nb * 16,
                "activation row shorter than the weight row"
            );
        }
        let st = match w.kind {
            KKind::Q2K => q2k::<R>(w.data, x),
            KKind::Q3K => q3k::<R>(w.data, x),
            KKind::Q4K if wide && batch => q4k_wide::<R, true>(w.data, x),
            KKind::Q4K if wide => q4k_wide::<R, false>(w.data, x),
            KKind::Q4K if batch => q4k::<R, true>(w.data, x),
            KKind::Q4K => q4k::<R, false>(w.data, x),
            KKind::Q5K if wide => q5k_wide::<R>(w.data, x),
            KKind::Q5K => q5k::<R>(w.data, x),
            KKind::Q6K if wide && batch => q6k_wide::<R, true>(w.data, x),
            KKind::Q6K if wide => q6k_wide::<R, false>(w.data, x),
            KKind::Q6K if batch => q6k::<R, true>(w.data, x),
            KKind::Q6K => q6k::<R, false>(w.data, x),
        };
        st.finish(w.kind, batch, out);
    }

    /// Per row and super-block, the 8 sums of each 32 quants (`bsums[2g] + bsums[2g + 1]`, i16
    /// wrapping adds as `_mm_hadd_epi16`): the operand of the Q4_K/Q5_K min products.
    pub(super) fn pair_sums(rows: &[Q8KRow], nb: usize) -> Vec<Vec<i16>> {
        rows.iter()
            .map(|x| {
                x.bsums[..nb * 16]
                    .chunks_exact(2)
                    .map(|p| p[0].wrapping_add(p[1]))
                    .collect()
            })
            .collect()
    }

    /// Q4_K / Q5_K / Q6_K as const generic parameters.
    const Q4K: u8 = 4;
    const Q5K: u8 = 5;
    const Q6K: u8 = 6;

    /// `[lo(a) + hi(a) | lo(b) + hi(b)]`: the 16-lane sums of two weight rows folded to ggml's
    /// 8 lanes each (exact i32 adds), row `a` in the low half.
    #[inline(always)]
    unsafe fn fold2(a: __m512i, b: __m512i) -> __m512i {
        let lo = _mm512_shuffle_i64x2::<0b01_00_01_00>(a, b);
        let hi = _mm512_shuffle_i64x2::<0b11_10_11_10>(a, b);
        _mm512_add_epi32(lo, hi)
    }

    /// Two f16 values (little-endian byte pairs) → `[f32(a) × 4, f32(b) × 4]`.
    #[inline(always)]
    unsafe fn f16_pair4(a: *const u8, b: *const u8) -> __m256 {
        let h = (a as *const u16).read_unaligned() as u32 | ((b as *const u16).read_unaligned() as u32) << 16;
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128(h as i32));
        _mm256_permutevar8x32_ps(_mm256_castps128_ps256(v), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1))
    }

    /// Q4_K/Q5_K scales and mins of two super-blocks (`sa`, `sb`: their 12 packed bytes, readable
    /// 16): [`scales_mins_k4`] four bytes at a time in vector lanes. Returns the 8 scales of each
    /// as i16 (lanes 0..8, for `vpermw`) and the mins as `[mins a | mins b]` (8 i16 each).
    #[inline(always)]
    unsafe fn k4_scales2(sa: *const u8, sb: *const u8) -> (__m512i, __m512i, __m256i) {
        // Per 128-bit half: [u0, u1, u2, -].
        let v = _mm256_set_m128i(ld128(sb), ld128(sa));
        let l1 = _mm256_shuffle_epi32::<0b10_01_10_00>(v); // [u0, u2, u1, u2]
        let l2 = _mm256_shuffle_epi32::<0b01_01_00_00>(v); // [u0, u0, u1, u1]
        let k1 = 0x3f3f_3f3f;
        let k2 = 0x0f0f_0f0f;
        let k3 = 0x0303_0303;
        // [u0 & K1, u2 & K2, u1 & K1, (u2 >> 4) & K2]
        let a = _mm256_and_si256(
            _mm256_srlv_epi32(l1, _mm256_setr_epi32(0, 0, 0, 4, 0, 0, 0, 4)),
            _mm256_setr_epi32(k1, k2, k1, k2, k1, k2, k1, k2),
        );
        // [0, ((u0 >> 6) & K3) << 4, 0, ((u1 >> 6) & K3) << 4]
        let b = _mm256_slli_epi32::<4>(_mm256_and_si256(
            _mm256_srli_epi32::<6>(l2),
            _mm256_setr_epi32(0, k3, 0, k3, 0, k3, 0, k3),
        ));
        // Bytes 0..8: scales, 8..16: mins (per half).
        let sm = _mm256_or_si256(a, b);
        let ma = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(sm));
        let mb = _mm256_cvtepu8_epi16(_mm256_extracti128_si256::<1>(sm));
        let mins2 = _mm256_permute2x128_si256::<0x31>(ma, mb);
        (_mm512_castsi256_si512(ma), _mm512_castsi256_si512(mb), mins2)
    }

    /// `vpdpwssd`: `acc + a[2i] b[2i] + a[2i+1] b[2i+1]` per i32 lane (exact, wrapping). Inline
    /// assembly, because LLVM otherwise splits most of them back into `vpmaddwd` + `vpaddd` (same
    /// result, one more instruction).
    #[inline]
    #[target_feature(enable = "avx512f,avx512vnni")]
    unsafe fn dpwssd(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
        let mut acc = acc;
        std::arch::asm!(
            "vpdpwssd {acc}, {a}, {b}",
            acc = inout(zmm_reg) acc,
            a = in(zmm_reg) a,
            b = in(zmm_reg) b,
            options(pure, nomem, nostack, preserves_flags)
        );
        acc
    }

    /// [`k4_scales2`] as arrays, for the tests.
    #[cfg(test)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
    pub(super) unsafe fn k4_scales2_for_test(sa: *const u8, sb: *const u8) -> ([i16; 32], [i16; 32], [i16; 16]) {
        let (a, b, m) = k4_scales2(sa, sb);
        let mut out = ([0i16; 32], [0i16; 32], [0i16; 16]);
        _mm512_storeu_si512(out.0.as_mut_ptr() as *mut _, a);
        _mm512_storeu_si512(out.1.as_mut_ptr() as *mut _, b);
        _mm256_storeu_si256(out.2.as_mut_ptr() as *mut __m256i, m);
        out
    }

    #[inline(always)]
    unsafe fn ldz(p: *const i16) -> __m512i {
        _mm512_loadu_si512(p as *const _)
    }

    /// `vpermw` controls for Q4_K/Q5_K: the scale operand of [`pack`]ed pair `p` (value vectors
    /// `2p` and `2p + 1`, each 64 values: chunk `2j` in the low half, `2j + 1` in the high):
    /// i16 `2i` is the scale of the first vector's i32 lane `i`, `2i + 1` the second's.
    static IDX4: [[i16; 32]; 2] = {
        let mut t = [[0i16; 32]; 2];
        let mut p = 0;
        while p < 2 {
            let mut i = 0;
            while i < 16 {
                let hi = (i >= 8) as usize;
                t[p][2 * i] = (4 * p + hi) as i16;
                t[p][2 * i + 1] = (4 * p + 2 + hi) as i16;
                i += 1;
            }
            p += 1;
        }
        t
    };

    /// `vpermw` controls for Q6_K: the scale operand of the [`pack`]ed pair of half `j` (value
    /// vectors of chunks `(4j, 4j + 1)` and `(4j + 2, 4j + 3)`); one scale per 16 values.
    static IDX6: [[i16; 32]; 2] = {
        let mut t = [[0i16; 32]; 2];
        let mut j = 0;
        while j < 2 {
            let mut i = 0;
            while i < 16 {
                // Lane i: chunk (i / 8) of the vector, values 4 (i % 8) .. + 4 of that chunk.
                let group = 2 * (i / 8) + (i % 8) / 4;
                t[j][2 * i] = (8 * j + group) as i16;
                t[j][2 * i + 1] = (8 * j + 4 + group) as i16;
                i += 1;
            }
            j += 1;
        }
        t
    };

    /// `vpdpbusd` from zero: per i32 lane `l`, the exact sum of the four products of unsigned
    /// weights `w` and signed quants `y` at bytes `4l .. 4l + 4` (|sum| ≤ 4 · 63 · 128, so it
    /// also fits in an i16).
    #[inline(always)]
    unsafe fn dot4(w: __m512i, y: __m512i) -> __m512i {
        _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, y)
    }

    /// Two `dot4` results as i16 pairs: lane `l` = (`a[l]`, `b[l]`) (each fits in an i16, so the
    /// truncation is exact), the operand of one `vpdpwssd` that scales and adds both.
    #[inline(always)]
    unsafe fn pack(a: __m512i, b: __m512i) -> __m512i {
        _mm512_permutex2var_epi16(a, ldz(PACK.as_ptr()), b)
    }

    /// `vpermt2w` control of [`pack`]: i16 `2i` from `a[2i]`, `2i + 1` from `b[2i]`.
    static PACK: [i16; 32] = {
        let mut t = [0i16; 32];
        let mut i = 0;
        while i < 16 {
            t[2 * i] = (2 * i) as i16;
            t[2 * i + 1] = (32 + 2 * i) as i16;
            i += 1;
        }
        t
    };

    /// Q6_K weights of one super-block half `j` (values 128j..128j+128), unsigned 0..63: the
    /// chunks `(4j, 4j + 1)` and `(4j + 2, 4j + 3)` as two 512-bit vectors (ggml's
    /// `q4bits | q4bitsH` assembly, 64 values at a time).
    #[inline(always)]
    unsafe fn q6k_weights(q: *const u8, j: usize) -> (__m512i, __m512i) {
        let ql = _mm512_loadu_si512(q.add(64 * j) as *const _);
        let qh = _mm512_broadcast_i64x4(ld(q.add(128 + 32 * j)));
        let m0f = _mm512_set1_epi8(0x0F);
        let m30 = _mm512_set1_epi8(0x30);
        // Bits 4..6 of each byte: qh bits (0,1) / (2,3) for chunks 4j / 4j+1 ...
        let sh01 = _mm512_inserti64x4::<1>(_mm512_set1_epi16(4), _mm256_set1_epi16(2));
        let h01 = _mm512_and_si512(_mm512_sllv_epi16(qh, sh01), m30);
        // ... and (4,5) / (6,7) for chunks 4j+2 / 4j+3.
        let sh23 = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(2));
        let h23 = _mm512_and_si512(_mm512_srlv_epi16(qh, sh23), m30);
        // (a & 0x0F) | b.
        let w01 = _mm512_ternarylogic_epi32::<0xEC>(ql, h01, m0f);
        let w23 = _mm512_ternarylogic_epi32::<0xEC>(_mm512_srli_epi16::<4>(ql), h23, m0f);
        (w01, w23)
    }

    /// The VNNI tile: two weight rows (`pa`, `pb`: their super-blocks) × `R` activation rows,
    /// for Q4_K/Q5_K/Q6_K. Per (weight row, activation row, super-block) the integer lanes are
    /// ggml's, computed as: `vpdpbusd` gives the exact sum of each 4 products (one i32 lane per
    /// ggml lane and 32-value chunk, two chunks per register); two such results are [`pack`]ed
    /// into i16 pairs (exact: |sum| < 2^15) and one `vpdpwssd` multiplies each by its chunk's
    /// scale and adds both to the lane (instead of `maddubs` + `madd` + `add` per chunk); the 16
    /// lanes are folded to ggml's 8 with exact i32 adds. Integer addition is associative, so the
    /// lanes equal ggml's exactly; the float operations are ggml's, with the two weight rows side
    /// by side in one 512-bit register (low half: `pa`).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile<const K: u8, const R: usize>(
        pa: *const u8,
        pb: *const u8,
        nb: usize,
        xs: &[&Q8KRow],
        q8s: &[Vec<i16>],
        out: &mut [f32],
        two: bool,
    ) {
        let x: [&Q8KRow; R] = std::array::from_fn(|r| xs[r]);
        let yq: [*const i8; R] = std::array::from_fn(|r| x[r].qs.as_ptr());
        let bs: [*const i16; R] = std::array::from_fn(|r| x[r].bsums.as_ptr());
        let ps: [*const i16; R] = std::array::from_fn(|r| q8s[r].as_ptr());
        let bb = match K {
            Q4K => 144,
            Q5K => 176,
            _ => 210,
        };
        let mut acc = [_mm512_setzero_ps(); R];
        // Q5_K's `summs` (lanes 0 and 4: rows a and b, the total in every lane of a half).
        let mut acc_m = [_mm256_setzero_ps(); R];
        // Q4_K's `sum` and `summs` of all pairs, in the lane order of `reduce_q4k`.
        let (mut acc4, mut acc4m) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        // The next tile's weight rows (two rows on): the pair's interleaved reads restart the
        // hardware prefetchers' streams at every row, which stalls on short rows.
        // Prefetch the weights of a tile ~8 KiB on (the same block of a later row pair): the
        // pair's interleaved reads restart the hardware prefetchers' streams at every row,
        // which stalls on short rows when the weights stream from memory.
        let row_bytes = nb * bb;
        let pf = 8192usize.div_ceil(row_bytes).max(2).next_multiple_of(2) * row_bytes;
        for b in 0..nb {
            let (qa, qb) = (pa.add(b * bb), pb.add(b * bb));
            for off in (0..bb).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(qa.wrapping_add(pf + off) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(qb.wrapping_add(pf + off) as *const i8);
            }
            let mut sumi = [[_mm512_setzero_si512(); 2]; R];
            let (dw2, dmin2, mins2);
            let mut sc16_2 = _mm512_setzero_si512();
            if K == Q6K {
                dw2 = f16_pair(
                    qa.add(208).cast::<u16>().read_unaligned(),
                    qb.add(208).cast::<u16>().read_unaligned(),
                );
                dmin2 = _mm256_setzero_ps();
                mins2 = _mm256_setzero_si256();
                let sa = _mm256_cvtepi8_epi16(ld128(qa.add(192)));
                let sb = _mm256_cvtepi8_epi16(ld128(qb.add(192)));
                sc16_2 = join(sa, sb);
                let sc = [_mm512_castsi256_si512(sa), _mm512_castsi256_si512(sb)];
                for (j, idx) in IDX6.iter().enumerate() {
                    let mut w01 = [_mm512_setzero_si512(); 2];
                    let mut w23 = [_mm512_setzero_si512(); 2];
                    let mut sp = [_mm512_setzero_si512(); 2];
                    for (h, q) in [qa, qb].into_iter().enumerate() {
                        let (lo, hi) = q6k_weights(q, j);
                        w01[h] = lo;
                        w23[h] = hi;
                        sp[h] = _mm512_permutexvar_epi16(ldz(idx.as_ptr()), sc[h]);
                    }
                    for r in 0..R {
                        let yp = yq[r].add(b * QK_K + 128 * j);
                        let y01 = _mm512_loadu_si512(yp as *const _);
                        let y23 = _mm512_loadu_si512(yp.add(64) as *const _);
                        for h in 0..2 {
                            let p = pack(dot4(w01[h], y01), dot4(w23[h], y23));
                            sumi[r][h] = dpwssd(sumi[r][h], p, sp[h]);
                        }
                    }
                }
            } else {
                dw2 = f16_pair(qa.cast::<u16>().read_unaligned(), qb.cast::<u16>().read_unaligned());
                dmin2 = f16_pair4(qa.add(2), qb.add(2));
                let (sca, scb, m2) = k4_scales2(qa.add(4), qb.add(4));
                mins2 = m2;
                let sc = [sca, scb];
                let hbits = if K == Q5K {
                    [
                        _mm512_broadcast_i64x4(ld(qa.add(16))),
                        _mm512_broadcast_i64x4(ld(qb.add(16))),
                    ]
                } else {
                    [_mm512_setzero_si512(); 2]
                };
                let off = if K == Q5K { 48 } else { 16 };
                let nib_shift = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(4));
                for (p, idx) in IDX4.iter().enumerate() {
                    let mut wv = [[_mm512_setzero_si512(); 2]; 2];
                    let mut sp = [_mm512_setzero_si512(); 2];
                    for (h, q) in [qa, qb].into_iter().enumerate() {
                        sp[h] = _mm512_permutexvar_epi16(ldz(idx.as_ptr()), sc[h]);
                        for (t, wt) in wv[h].iter_mut().enumerate() {
                            let j = 2 * p + t;
                            // [low nibbles | high nibbles] of the 32 bytes: values 64j..64j+64.
                            let bits = _mm512_broadcast_i64x4(ld(q.add(off + 32 * j)));
                            let w = _mm512_and_si512(_mm512_srlv_epi16(bits, nib_shift), _mm512_set1_epi8(0xF));
                            *wt = if K == Q5K {
                                // Fifth bit: bit 2j of `qh` for the low nibbles, 2j + 1 for the high.
                                let bit = _mm512_inserti64x4::<1>(
                                    _mm512_set1_epi8(1 << (2 * j)),
                                    _mm256_set1_epi8(1 << (2 * j + 1)),
                                );
                                let k = _mm512_test_epi8_mask(hbits[h], bit);
                                _mm512_mask_add_epi8(w, k, w, _mm512_set1_epi8(16))
                            } else {
                                w
                            };
                        }
                    }
                    for r in 0..R {
                        let yp = yq[r].add(b * QK_K + 128 * p);
                        let y0 = _mm512_loadu_si512(yp as *const _);
                        let y1 = _mm512_loadu_si512(yp.add(64) as *const _);
                        for h in 0..2 {
                            let pk = pack(dot4(wv[h][0], y0), dot4(wv[h][1], y1));
                            sumi[r][h] = dpwssd(sumi[r][h], pk, sp[h]);
                        }
                    }
                }
            }
            if K == Q4K {
                // ggml's repacked gemv: per weight row, activation row and super-block, one
                // FMA of the exact integer total (and one of the min products' total). The
                // totals of all 2 × 8 (weight row, activation row) pairs come out of one
                // transposing reduction, in the lane order of `reduce_q4k`.
                let mut l = [_mm512_setzero_si512(); 8];
                let mut pm = [_mm256_setzero_si256(); 8];
                let mut ys = [0f32; 8];
                for r in 0..R {
                    l[r] = fold2(sumi[r][0], sumi[r][1]);
                    let q8 = _mm256_broadcastsi128_si256(ld128(ps[r].add(b * 8) as *const u8));
                    pm[r] = _mm256_madd_epi16(mins2, q8);
                    ys[r] = *x[r].d.get_unchecked(b);
                }
                let (z, zm) = reduce_q4k(&l, &pm);
                let y = _mm512_permutexvar_ps(
                    _mm512_loadu_si512(Q4K_Y.as_ptr() as *const _),
                    _mm512_castps256_ps512(_mm256_loadu_ps(ys.as_ptr())),
                );
                let dq = _mm512_permutexvar_ps(_mm512_loadu_si512(Q4K_D.as_ptr() as *const _), dw2);
                let dm = _mm256_castps_pd(dmin2);
                let dmq = _mm512_castpd_ps(_mm512_insertf64x4::<1>(_mm512_castpd256_pd512(dm), dm));
                acc4 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(z), _mm512_mul_ps(dq, y), acc4);
                acc4m = _mm512_fmadd_ps(_mm512_cvtepi32_ps(zm), _mm512_mul_ps(dmq, y), acc4m);
                continue;
            }
            for r in 0..R {
                let yd = *x[r].d.get_unchecked(b);
                let mut lanes = fold2(sumi[r][0], sumi[r][1]);
                if K == Q6K {
                    let bsv = _mm512_broadcast_i64x4(ld(bs[r].add(b * 16) as *const u8));
                    lanes = _mm512_sub_epi32(lanes, _mm512_slli_epi32::<5>(_mm512_madd_epi16(bsv, sc16_2)));
                } else {
                    let q8 = _mm256_broadcastsi128_si256(ld128(ps[r].add(b * 8) as *const u8));
                    let prod = _mm256_madd_epi16(mins2, q8);
                    // Q5_K's scalar min sum of each weight row: the four products' integer
                    // total in every lane of its half.
                    let t = _mm256_add_epi32(prod, _mm256_shuffle_epi32::<0b01_00_11_10>(prod));
                    let prod = _mm256_cvtepi32_ps(_mm256_add_epi32(t, _mm256_shuffle_epi32::<0b10_11_00_01>(t)));
                    acc_m[r] = _mm256_fmadd_ps(_mm256_mul_ps(dmin2, _mm256_set1_ps(-yd)), prod, acc_m[r]);
                }
                acc[r] = _mm512_fmadd_ps(
                    _mm512_mul_ps(dw2, _mm512_set1_ps(yd)),
                    _mm512_cvtepi32_ps(lanes),
                    acc[r],
                );
            }
        }
        if K == Q4K {
            let mut v = [0f32; 16];
            _mm512_storeu_ps(v.as_mut_ptr(), _mm512_sub_ps(acc4, acc4m));
            for (i, &vi) in v.iter().enumerate() {
                let (h, r) = ((i / 4) % 2, i % 4 + 4 * (i / 8));
                if r < R && (h == 0 || two) {
                    out[r * (1 + usize::from(two)) + h] = vi;
                }
            }
            return;
        }
        for r in 0..R {
            let (ha, hb) = crate::kernels::qmatmul::vnni_impl::hsum_halves(acc[r]);
            let mut m = [0f32; 8];
            _mm256_storeu_ps(m.as_mut_ptr(), acc_m[r]);
            for (h, v) in [(0, ha), (1, hb)] {
                if h == 1 && !two {
                    continue;
                }
                out[r * (1 + usize::from(two)) + h] = match K {
                    Q5K => v + m[4 * h],
                    _ => v,
                };
            }
        }
    }

    /// `vpermps` controls of the Q4_K tile's lane order (see [`reduce_q4k`]): each lane's
    /// activation row scale (from 8 row scales) and weight row scale (from `[a × 8 | b × 8]`).
    static Q4K_Y: [i32; 16] = [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7];
    static Q4K_D: [i32; 16] = [0, 0, 0, 0, 8, 8, 8, 8, 0, 0, 0, 0, 8, 8, 8, 8];

    /// The exact integer totals of the Q4_K tile's 2 × 8 (weight row, activation row) pairs:
    /// from `l[r]` (activation row `r`: weight row a's 8 lanes, then b's) and `pm[r]` (the min
    /// products, a's 4 then b's), a transposing tree of i32 adds. Lane `i` of both results
    /// belongs to weight row `(i / 4) % 2` and activation row `i % 4 + 4 * (i / 8)`.
    #[inline(always)]
    unsafe fn reduce_q4k(l: &[__m512i; 8], pm: &[__m256i; 8]) -> (__m512i, __m512i) {
        // Per 128-bit lane: [x0 + x2, y0 + y2, x1 + x3, y1 + y3].
        let u = |x: __m512i, y: __m512i| _mm512_add_epi32(_mm512_unpacklo_epi32(x, y), _mm512_unpackhi_epi32(x, y));
        // Per 128-bit lane: the 4-lane totals of the four vectors behind `x` and `y`.
        let v = |x: __m512i, y: __m512i| _mm512_add_epi32(_mm512_unpacklo_epi64(x, y), _mm512_unpackhi_epi64(x, y));
        let lo = v(u(l[0], l[1]), u(l[2], l[3])); // 128-bit lanes [a0-3, a4-7, b0-3, b4-7] of rows 0..4
        let hi = v(u(l[4], l[5]), u(l[6], l[7]));
        let x = _mm512_shuffle_i64x2::<0b10_00_10_00>(lo, hi);
        let y = _mm512_shuffle_i64x2::<0b11_01_11_01>(lo, hi);
        let z = _mm512_add_epi32(x, y);
        let u2 = |x: __m256i, y: __m256i| _mm256_add_epi32(_mm256_unpacklo_epi32(x, y), _mm256_unpackhi_epi32(x, y));
        let v2 = |x: __m256i, y: __m256i| _mm256_add_epi32(_mm256_unpacklo_epi64(x, y), _mm256_unpackhi_epi64(x, y));
        let mlo = v2(u2(pm[0], pm[1]), u2(pm[2], pm[3])); // [a rows 0..4 | b rows 0..4]
        let mhi = v2(u2(pm[4], pm[5]), u2(pm[6], pm[7]));
        (z, _mm512_inserti64x4::<1>(_mm512_castsi256_si512(mlo), mhi))
    }

    /// [`tile`] for the row count.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile_rows<const K: u8>(
        pa: *const u8,
        pb: *const u8,
        nb: usize,
        xs: &[&Q8KRow],
        q8s: &[Vec<i16>],
        out: &mut [f32],
        two: bool,
    ) {
        match xs.len() {
            1 => tile::<K, 1>(pa, pb, nb, xs, q8s, out, two),
            2 => tile::<K, 2>(pa, pb, nb, xs, q8s, out, two),
            3 => tile::<K, 3>(pa, pb, nb, xs, q8s, out, two),
            4 => tile::<K, 4>(pa, pb, nb, xs, q8s, out, two),
            5 => tile::<K, 5>(pa, pb, nb, xs, q8s, out, two),
            6 => tile::<K, 6>(pa, pb, nb, xs, q8s, out, two),
            7 => tile::<K, 7>(pa, pb, nb, xs, q8s, out, two),
            8 => tile::<K, 8>(pa, pb, nb, xs, q8s, out, two),
            g => panic!("group of {g} rows"),
        }
    }

    /// One tile of a Q4_K/Q5_K/Q6_K product on the VNNI kernel: weight rows `j0 .. j0 + nw`
    /// (`nw` ≤ 2) × the rows `xs` (with their [`pair_sums`] `q8s`), `out[r * nw + w]`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn tile_dispatch(
        w: &KWeight,
        xs: &[&Q8KRow],
        q8s: &[Vec<i16>],
        j0: usize,
        nw: usize,
        out: &mut [f32],
    ) {
        let nb = w.k / QK_K;
        let g = xs.len();
        assert!(
            (1..=2).contains(&nw) && j0 + nw <= w.n && q8s.len() == g && out.len() >= nw * g,
            "tile out of range"
        );
        for (x, s) in xs.iter().zip(q8s) {
            assert!(
                x.d.len() >= nb && x.qs.len() >= nb * QK_K && x.bsums.len() >= nb * 16 && s.len() >= nb * 8,
                "activation row shorter than the weight row"
            );
        }
        let rb = nb * w.kind.block_bytes();
        let pa = w.data[j0 * rb..].as_ptr();
        let pb = w.data[(j0 + nw - 1) * rb..(j0 + nw) * rb].as_ptr();
        let two = nw == 2;
        match w.kind {
            KKind::Q4K => tile_rows::<Q4K>(pa, pb, nb, xs, q8s, out, two),
            KKind::Q5K => tile_rows::<Q5K>(pa, pb, nb, xs, q8s, out, two),
            KKind::Q6K => tile_rows::<Q6K>(pa, pb, nb, xs, q8s, out, two),
            _ => panic!("no VNNI tile for {:?}", w.kind),
        }
    }

    /// Two 256-bit halves as one 512-bit vector (`lo` in the low half).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn join(lo: __m256i, hi: __m256i) -> __m512i {
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
    }

    /// The 512-bit lane sums folded back to ggml's 8 lanes (exact i32 adds).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn fold(v: __m512i) -> __m256i {
        _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
    }

    /// [`q4k`] with two 32-value chunks per 512-bit operation (AVX-512 BW): the same exact
    /// integer lanes, the same float operations.
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn q4k_wide<const R: usize, const BATCH: bool>(data: &[u8], x: [&Q8KRow; R]) -> State<R> {
        let m4 = _mm256_set1_epi8(0xF);
        let mut st = State::<R>::new();
        let mut isums = [[0i32; 4]; R];
        for (b, blk) in data.chunks_exact(144).enumerate() {
            let p = blk.as_ptr();
            prefetch_ahead(p, 144);
            let dw = h2f(blk[0], blk[1]);
            let dminw = h2f(blk[2], blk[3]);
            let sm = scales_mins_k4(&blk[4..16]);
            let ms = _mm256_cvtepu8_epi16(ld128(sm.as_ptr()));
            let sc128 = _mm256_castsi256_si128(ms);
            let mins = _mm256_extracti128_si256::<1>(ms);
            let scales = _mm256_set_m128i(sc128, sc128);
            let mut sumi = [_mm512_setzero_si512(); R];
            for j in 0..4 {
                let sl = _mm256_shuffle_epi8(scales, ld(K4[2 * j].as_ptr()));
                let sh = _mm256_shuffle_epi8(scales, ld(K4[2 * j + 1].as_ptr()));
                let s = join(sl, sh);
                let bits = ld(p.add(16 + 32 * j));
                let w = join(
                    _mm256_and_si256(bits, m4),
                    _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4),
                );
                for r in 0..R {
                    let y = _mm512_loadu_si512(x[r].qs.as_ptr().add(b * QK_K + 64 * j) as *const _);
                    let t = _mm512_madd_epi16(s, _mm512_maddubs_epi16(w, y));
                    if BATCH {
                        isums[r][j] = hsum8_epi32(fold(t));
                    } else {
                        sumi[r] = _mm512_add_epi32(sumi[r], t);
                    }
                }
            }
            for r in 0..R {
                let bs = bsums(x[r], b);
                let q8s = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256::<1>(bs));
                let prod = _mm_madd_epi16(mins, q8s);
                let yd = x[r].d[b];
                if BATCH {
                    st.q4k_sb_steps(r, &isums[r], prod, dw * yd, dminw * yd);
                } else {
                    st.q4k_step(r, fold(sumi[r]), prod, dw * yd, dminw * yd);
                }
            }
        }
        st
    }

    /// [`q5k`] with two 32-value chunks per 512-bit operation (AVX-512 BW).
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn q5k_wide<const R: usize>(data: &[u8], x: [&Q8KRow; R]) -> State<R> {
        let m4 = _mm256_set1_epi8(0xF);
        let one = _mm256_set1_epi8(1);
        let mut st = State::<R>::new();
        for (b, blk) in data.chunks_exact(176).enumerate() {
            let p = blk.as_ptr();
            prefetch_ahead(p, 176);
            let dw = h2f(blk[0], blk[1]);
            let dminw = h2f(blk[2], blk[3]);
            let sm = scales_mins_k4(&blk[4..16]);
            let ms = _mm256_cvtepu8_epi16(ld128(sm.as_ptr()));
            let sc128 = _mm256_castsi256_si128(ms);
            let mins = _mm256_extracti128_si256::<1>(ms);
            let scales = _mm256_set_m128i(sc128, sc128);
            let hbits = ld(p.add(16));
            let mut sumi = [_mm512_setzero_si512(); R];
            for j in 0..4 {
                let sl = _mm256_shuffle_epi8(scales, ld(K4[2 * j].as_ptr()));
                let sh = _mm256_shuffle_epi8(scales, ld(K4[2 * j + 1].as_ptr()));
                let s = join(sl, sh);
                let bits = ld(p.add(48 + 32 * j));
                let h0 = _mm256_and_si256(_mm256_srl_epi16(hbits, _mm_cvtsi32_si128(2 * j as i32)), one);
                let h1 = _mm256_and_si256(_mm256_srl_epi16(hbits, _mm_cvtsi32_si128(2 * j as i32 + 1)), one);
                let lo = _mm256_or_si256(_mm256_and_si256(bits, m4), _mm256_slli_epi16::<4>(h0));
                let hi = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4),
                    _mm256_slli_epi16::<4>(h1),
                );
                let w = join(lo, hi);
                for r in 0..R {
                    let y = _mm512_loadu_si512(x[r].qs.as_ptr().add(b * QK_K + 64 * j) as *const _);
                    sumi[r] = _mm512_add_epi32(sumi[r], _mm512_madd_epi16(s, _mm512_maddubs_epi16(w, y)));
                }
            }
            for r in 0..R {
                let bs = bsums(x[r], b);
                let q8s = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256::<1>(bs));
                let prod = _mm_madd_epi16(mins, q8s);
                let mut pv = [0i32; 4];
                _mm_storeu_si128(pv.as_mut_ptr() as *mut __m128i, prod);
                let yd = x[r].d[b];
                st.summs[r] = (-yd * dminw).mul_add(((pv[0] + pv[1]) + (pv[2] + pv[3])) as f32, st.summs[r]);
                st.acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(yd * dw), _mm256_cvtepi32_ps(fold(sumi[r])), st.acc[r]);
            }
        }
        st
    }

    /// [`q6k`] with two 32-value chunks per 512-bit operation (AVX-512 BW).
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn q6k_wide<const R: usize, const BATCH: bool>(data: &[u8], x: [&Q8KRow; R]) -> State<R> {
        let m3 = _mm256_set1_epi8(3);
        let m15 = _mm256_set1_epi8(15);
        let mut st = State::<R>::new();
        for (b, blk) in data.chunks_exact(210).enumerate() {
            let p = blk.as_ptr();
            prefetch_ahead(p, 210);
            let dw = h2f(blk[208], blk[209]);
            let sc16 = _mm256_cvtepi8_epi16(ld128(p.add(192)));
            let scv = pair_scales(sc16);
            let mut sumi = [_mm512_setzero_si512(); R];
            for j in 0..2 {
                let b1 = ld(p.add(64 * j));
                let b2 = ld(p.add(64 * j + 32));
                let bh = ld(p.add(128 + 32 * j));
                let h0 = _mm256_slli_epi16::<4>(_mm256_and_si256(bh, m3));
                let h1 = _mm256_slli_epi16::<2>(_mm256_and_si256(bh, _mm256_set1_epi8(12)));
                let h2 = _mm256_and_si256(bh, _mm256_set1_epi8(48));
                let h3 = _mm256_srli_epi16::<2>(_mm256_and_si256(bh, _mm256_set1_epi8(-64)));
                let w01 = join(
                    _mm256_or_si256(_mm256_and_si256(b1, m15), h0),
                    _mm256_or_si256(_mm256_and_si256(b2, m15), h1),
                );
                let w23 = join(
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(b1), m15), h2),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(b2), m15), h3),
                );
                let s01 = join(scv[4 * j], scv[4 * j + 1]);
                let s23 = join(scv[4 * j + 2], scv[4 * j + 3]);
                for r in 0..R {
                    let yp = x[r].qs.as_ptr().add(b * QK_K + 128 * j);
                    let y01 = _mm512_loadu_si512(yp as *const _);
                    let y23 = _mm512_loadu_si512(yp.add(64) as *const _);
                    let t01 = _mm512_madd_epi16(s01, _mm512_maddubs_epi16(w01, y01));
                    let t23 = _mm512_madd_epi16(s23, _mm512_maddubs_epi16(w23, y23));
                    sumi[r] = _mm512_add_epi32(sumi[r], _mm512_add_epi32(t01, t23));
                }
            }
            for r in 0..R {
                let corr = _mm256_slli_epi32::<5>(_mm256_madd_epi16(bsums(x[r], b), sc16));
                let lanes = _mm256_sub_epi32(fold(sumi[r]), corr);
                if BATCH {
                    st.sum[r] = (hsum8_epi32(lanes) as f32 * dw).mul_add(x[r].d[b], st.sum[r]);
                } else {
                    st.acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r].d[b] * dw), _mm256_cvtepi32_ps(lanes), st.acc[r]);
                }
            }
        }
        st
    }

    /// Q4_K for `R` rows: ggml's `ggml_vec_dot_q4_K_q8_K` (AVX2) integer lanes, with the float
    /// steps of its repacked gemv (or, `BATCH`, gemm).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4k<const R: usize, const BATCH: bool>(data: &[u8], x: [&Q8KRow; R]) -> State<R> {
        let m4 = _mm256_set1_epi8(0xF);
        let mut st = State::<R>::new();
        let mut isums = [[0i32; 4]; R];
        for (b, blk) in data.chunks_exact(144).enumerate() {
            let p = blk.as_ptr();
            prefetch_ahead(p, 144);
            let dw = h2f(blk[0], blk[1]);
            let dminw = h2f(blk[2], blk[3]);
            let sm = scales_mins_k4(&blk[4..16]);
            let ms = _mm256_cvtepu8_epi16(ld128(sm.as_ptr()));
            let sc128 = _mm256_castsi256_si128(ms);
            let mins = _mm256_extracti128_si256::<1>(ms);
            let scales = _mm256_set_m128i(sc128, sc128);
            let mut sumi = [_mm256_setzero_si256(); R];
            for j in 0..4 {
                let sl = _mm256_shuffle_epi8(scales, ld(K4[2 * j].as_ptr()));
                let sh = _mm256_shuffle_epi8(scales, ld(K4[2 * j + 1].as_ptr()));
                let bits = ld(p.add(16 + 32 * j));
                let lo = _mm256_and_si256(bits, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4);
                for r in 0..R {
                    let pl = chunk(lo, q8(x[r], b, 64 * j), sl);
                    let ph = chunk(hi, q8(x[r], b, 64 * j + 32), sh);
                    if BATCH {
                        isums[r][j] = hsum8_epi32(_mm256_add_epi32(pl, ph));
                    } else {
                        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(pl, ph));
                    }
                }
            }
            for r in 0..R {
                let bs = bsums(x[r], b);
                let q8s = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256::<1>(bs));
                let prod = _mm_madd_epi16(mins, q8s);
                let yd = x[r].d[b];
                if BATCH {
                    st.q4k_sb_steps(r, &isums[r], prod, dw * yd, dminw * yd);
                } else {
                    st.q4k_step(r, sumi[r], prod, dw * yd, dminw * yd);
                }
            }
        }
        st
    }

    /// ggml `ggml_vec_dot_q5_K_q8_K` (AVX2) for `R` rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q5k<const R: usize>(data: &[u8], x: [&Q8KRow; R]) -> State<R> {
        let m4 = _mm256_set1_epi8(0xF);
        let one = _mm256_set1_epi8(1);
        let mut st = State::<R>::new();
        for (b, blk) in data.chunks_exact(176).enumerate() {
            let p = blk.as_ptr();
            prefetch_ahead(p, 176);
            let dw = h2f(blk[0], blk[1]);
            let dminw = h2f(blk[2], blk[3]);
            let sm = scales_mins_k4(&blk[4..16]);
            let ms = _mm256_cvtepu8_epi16(ld128(sm.as_ptr()));
            let sc128 = _mm256_castsi256_si128(ms);
            let mins = _mm256_extracti128_si256::<1>(ms);
            let scales = _mm256_set_m128i(sc128, sc128);
            let hbits = ld(p.add(16));
            let mut sumi = [_mm256_setzero_si256(); R];
            for j in 0..4 {
                let sl = _mm256_shuffle_epi8(scales, ld(K4[2 * j].as_ptr()));
                let sh = _mm256_shuffle_epi8(scales, ld(K4[2 * j + 1].as_ptr()));
                let bits = ld(p.add(48 + 32 * j));
                let h0 = _mm256_and_si256(_mm256_srl_epi16(hbits, _mm_cvtsi32_si128(2 * j as i32)), one);
                let h1 = _mm256_and_si256(_mm256_srl_epi16(hbits, _mm_cvtsi32_si128(2 * j as i32 + 1)), one);
                let lo = _mm256_or_si256(_mm256_and_si256(bits, m4), _mm256_slli_epi16::<4>(h0));
                let hi = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4),
                    _mm256_slli_epi16::<4>(h1),
                );
                for r in 0..R {
                    let pl = chunk(lo, q8(x[r], b, 64 * j), sl);
                    let ph = chunk(hi, q8(x[r], b, 64 * j + 32), sh);
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(pl, ph));
                }
            }
            for r in 0..R {
                let bs = bsums(x[r], b);
                let q8s = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256::<1>(bs));
                let prod = _mm_madd_epi16(mins, q8s);
                let mut pv = [0i32; 4];
                _mm_storeu_si128(pv.as_mut_ptr() as *mut __m128i, prod);
                let yd = x[r].d[b];
                st.summs[r] = (-yd * dminw).mul_add(((pv[0] + pv[1]) + (pv[2] + pv[3])) as f32, st.summs[r]);
                st.acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(yd * dw), _mm256_cvtepi32_ps(sumi[r]), st.acc[r]);
            }
        }
        st
    }

    /// ggml `ggml_vec_dot_q6_K_q8_K` (AVX2) for `R` rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q6k<const R: usize, const BATCH: bool>(data: &[u8], x: [&Q8KRow; R]) -> State<R> {
        let m3 = _mm256_set1_epi8(3);
        let m15 = _mm256_set1_epi8(15);
        let mut st = State::<R>::new();
        for (b, blk) in data.chunks_exact(210).enumerate() {
            let p = blk.as_ptr();
            prefetch_ahead(p, 210);
            let dw = h2f(blk[208], blk[209]);
            let sc16 = _mm256_cvtepi8_epi16(ld128(p.add(192)));
            let scv = pair_scales(sc16);
            let mut sumi = [_mm256_setzero_si256(); R];
            for j in 0..2 {
                let b1 = ld(p.add(64 * j));
                let b2 = ld(p.add(64 * j + 32));
                let bh = ld(p.add(128 + 32 * j));
                let h0 = _mm256_slli_epi16::<4>(_mm256_and_si256(bh, m3));
                let h1 = _mm256_slli_epi16::<2>(_mm256_and_si256(bh, _mm256_set1_epi8(12)));
                let h2 = _mm256_and_si256(bh, _mm256_set1_epi8(48));
                let h3 = _mm256_srli_epi16::<2>(_mm256_and_si256(bh, _mm256_set1_epi8(-64)));
                let w = [
                    _mm256_or_si256(_mm256_and_si256(b1, m15), h0),
                    _mm256_or_si256(_mm256_and_si256(b2, m15), h1),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(b1), m15), h2),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(b2), m15), h3),
                ];
                for r in 0..R {
                    let mut t = [_mm256_setzero_si256(); 4];
                    for (c, tc) in t.iter_mut().enumerate() {
                        *tc = chunk(w[c], q8(x[r], b, 128 * j + 32 * c), scv[4 * j + c]);
                    }
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(t[0], t[1]));
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(t[2], t[3]));
                }
            }
            for r in 0..R {
                let corr = _mm256_slli_epi32::<5>(_mm256_madd_epi16(bsums(x[r], b), sc16));
                let lanes = _mm256_sub_epi32(sumi[r], corr);
                if BATCH {
                    st.sum[r] = (hsum8_epi32(lanes) as f32 * dw).mul_add(x[r].d[b], st.sum[r]);
                } else {
                    st.acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r].d[b] * dw), _mm256_cvtepi32_ps(lanes), st.acc[r]);
                }
            }
        }
        st
    }

    /// ggml `ggml_vec_dot_q2_K_q8_K` (AVX2) for `R` rows.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q2k<const R: usize>(data: &[u8], x: [&Q8KRow; R]) -> State<R> {
        let m3 = _mm256_set1_epi8(3);
        let m4 = _mm_set1_epi8(0xF);
        let mut st = State::<R>::new();
        for (b, blk) in data.chunks_exact(84).enumerate() {
            let p = blk.as_ptr();
            let dw = h2f(blk[80], blk[81]);
            let dminw = h2f(blk[82], blk[83]);
            let sm = ld128(p);
            let sc16 = _mm256_cvtepi8_epi16(_mm_and_si128(sm, m4));
            let mins16 = _mm256_cvtepi8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(sm), m4));
            let scv = pair_scales(sc16);
            let mut sumi = [_mm256_setzero_si256(); R];
            for j in 0..2 {
                let bits = ld(p.add(16 + 32 * j));
                let w = [
                    _mm256_and_si256(bits, m3),
                    _mm256_and_si256(_mm256_srli_epi16::<2>(bits), m3),
                    _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m3),
                    _mm256_and_si256(_mm256_srli_epi16::<6>(bits), m3),
                ];
                for r in 0..R {
                    let mut t = [_mm256_setzero_si256(); 4];
                    for (c, tc) in t.iter_mut().enumerate() {
                        *tc = chunk(w[c], q8(x[r], b, 128 * j + 32 * c), scv[4 * j + c]);
                    }
                    let t01 = _mm256_add_epi32(t[0], t[1]);
                    let t23 = _mm256_add_epi32(t[2], t[3]);
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(t01, t23));
                }
            }
            for r in 0..R {
                let prod = _mm256_madd_epi16(mins16, bsums(x[r], b));
                let yd = x[r].d[b];
                st.acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(-yd * dminw), _mm256_cvtepi32_ps(prod), st.acc[r]);
                st.acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(yd * dw), _mm256_cvtepi32_ps(sumi[r]), st.acc[r]);
            }
        }
        st
    }

    /// ggml `ggml_vec_dot_q3_K_q8_K` (AVX2) for `R` rows. The weights are formed signed
    /// (`low2 - 4 * !high`) and multiplied with the sign trick (exact: Q8_K quants are never
    /// -128), which gives the same integer lanes as ggml's two `maddubs` and a subtraction.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q3k<const R: usize>(data: &[u8], x: [&Q8KRow; R]) -> State<R> {
        let m3 = _mm256_set1_epi8(3);
        let one = _mm256_set1_epi8(1);
        let mut st = State::<R>::new();
        for (b, blk) in data.chunks_exact(110).enumerate() {
            let p = blk.as_ptr();
            let dw = h2f(blk[108], blk[109]);
            let sc = scales_q3k(&blk[96..108]);
            let sc16 = _mm256_cvtepi8_epi16(ld128(sc.as_ptr() as *const u8));
            let scv = pair_scales(sc16);
            let hbits = ld(p);
            let mut sumi = [_mm256_setzero_si256(); R];
            for j in 0..2 {
                let bits = ld(p.add(32 + 32 * j));
                let low = [
                    _mm256_and_si256(bits, m3),
                    _mm256_and_si256(_mm256_srli_epi16::<2>(bits), m3),
                    _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m3),
                    _mm256_and_si256(_mm256_srli_epi16::<6>(bits), m3),
                ];
                let mut w = [_mm256_setzero_si256(); 4];
                let mut aw = [_mm256_setzero_si256(); 4];
                for c in 0..4 {
                    let hb = _mm256_and_si256(_mm256_srl_epi16(hbits, _mm_cvtsi32_si128((4 * j + c) as i32)), one);
                    let sub = _mm256_slli_epi16::<2>(_mm256_andnot_si256(hb, one));
                    w[c] = _mm256_sub_epi8(low[c], sub);
                    aw[c] = _mm256_sign_epi8(w[c], w[c]);
                }
                for r in 0..R {
                    let mut t = [_mm256_setzero_si256(); 4];
                    for (c, tc) in t.iter_mut().enumerate() {
                        let y = _mm256_sign_epi8(q8(x[r], b, 128 * j + 32 * c), w[c]);
                        *tc = chunk(aw[c], y, scv[4 * j + c]);
                    }
                    let t01 = _mm256_add_epi32(t[0], t[1]);
                    let t23 = _mm256_add_epi32(t[2], t[3]);
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_add_epi32(t01, t23));
                }
            }
            for r in 0..R {
                st.acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x[r].d[b] * dw), _mm256_cvtepi32_ps(sumi[r]), st.acc[r]);
            }
        }
        st
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QMatMul;
    use candle_core::{Device, Module, Tensor};

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
        GgmlDType::Q2K,
        GgmlDType::Q3K,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
    ];

    /// The AVX-512 and AVX2 Q8_K block quantizations give the scalar definition's quants, sums
    /// and scale: random blocks at several magnitudes, zeros, ties of the largest magnitude (both
    /// signs, so the first one decides), exact halves.
    #[test]
    fn simd_q8k_quantization_matches_scalar() {
        #[cfg(target_arch = "x86_64")]
        {
            let (avx512, avx2) = (has_avx512(), super::super::qmatmul::has_avx2());
            if !avx512 && !avx2 {
                return;
            }
            for case in 0..2000u64 {
                let scale = [1e-30f32, 1e-3, 1.0, 300.0, 1e20][(case % 5) as usize];
                let mut x: Vec<f32> = pseudo(QK_K, case + 1).iter().map(|v| v * scale).collect();
                match case % 6 {
                    0 => x.iter_mut().for_each(|v| *v = 0.0),
                    1 => {
                        let i = (case as usize * 37) % QK_K;
                        let j = (i + 1 + case as usize % 200) % QK_K;
                        x[i] = 2.0 * scale;
                        x[j] = -2.0 * scale;
                    }
                    2 => {
                        x[5] = -127.0;
                        for (i, v) in x.iter_mut().enumerate().skip(6).take(100) {
                            *v = (i % 50) as f32 - 24.5;
                        }
                    }
                    _ => {}
                }
                // A block below 127 / f32::MAX (an infinite -127 / max), an infinite lane and a
                // NaN lane: the SIMD paths keep the scalar's bytes and sums there too.
                if case % 13 == 12 {
                    match case % 3 {
                        0 => x.iter_mut().for_each(|v| *v *= 1e-38 / scale),
                        1 => x[(case as usize * 7) % QK_K] = f32::NEG_INFINITY,
                        _ => x[(case as usize * 7) % QK_K] = f32::NAN,
                    }
                }
                let (mut q1, mut s1) = (vec![0i8; QK_K], [0i16; 16]);
                let d1 = quantize_block_q8k(&x, &mut q1, &mut s1);
                type Simd = unsafe fn(&[f32], &mut [i8], &mut [i16]) -> f32;
                let paths: [(&str, bool, Simd); 2] = [
                    ("avx512", avx512, quantize_block_q8k_avx512),
                    ("avx2", avx2, quantize_block_q8k_avx2),
                ];
                for (isa, _, f) in paths.into_iter().filter(|p| p.1) {
                    let (mut q2, mut s2) = (vec![0i8; QK_K], [0i16; 16]);
                    // SAFETY: the path's instruction set is present (checked above).
                    let d2 = unsafe { f(&x, &mut q2, &mut s2) };
                    assert_eq!(q1, q2, "{isa} case {case}");
                    assert_eq!(s1, s2, "{isa} case {case}");
                    assert_eq!(d1.to_bits(), d2.to_bits(), "{isa} case {case}");
                }
            }
        }
    }

    /// Against the exact product with the dequantized weights (Q8_K rounding of the activations
    /// is the only difference), and against candle's own K-quant `QMatMul` (same quantization,
    /// another summation order).
    #[test]
    fn close_to_dequantized_product() {
        let (n, k, m) = (40, 512, 3);
        let x = pseudo(m * k, 9);
        let xt = Tensor::from_vec(x.clone(), (m, k), &Device::Cpu).unwrap();
        for dt in KINDS {
            let (q, deq) = weight(dt, n, k);
            let w = KWeight::from_qtensor(&q).unwrap().unwrap();
            let y = w.matmul(&x, m);
            let theirs = QMatMul::from_qtensor(q)
                .unwrap()
                .forward(&xt)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            for i in 0..m {
                for j in 0..n {
                    let want: f32 = (0..k).map(|t| x[i * k + t] * deq[j * k + t]).sum();
                    let got = y[i * n + j];
                    let norm: f32 = (0..k).map(|t| (x[i * k + t] * deq[j * k + t]).abs()).sum();
                    assert!(
                        (want - got).abs() < 0.01 * norm,
                        "{dt:?} [{i},{j}] exact {want} vs ours {got} (norm {norm})"
                    );
                    let c = theirs[i * n + j];
                    assert!(
                        (c - got).abs() < 1e-4 * norm,
                        "{dt:?} [{i},{j}] candle {c} vs ours {got} (norm {norm})"
                    );
                }
            }
        }
    }

    #[test]
    fn rows_are_batch_invariant_and_paths_agree() {
        let (n, k) = (36, 768);
        for dt in KINDS {
            let (q, _) = weight(dt, n, k);
            let w = KWeight::from_qtensor(&q).unwrap().unwrap();
            for m in [2usize, 5, 9, 17, 49, 50] {
                let x = pseudo(m * k, m as u64);
                let many = w.matmul(&x, m);
                for i in 0..m {
                    let one = w.matmul(&x[i * k..(i + 1) * k], 1);
                    let a: Vec<u32> = many[i * n..(i + 1) * n].iter().map(|v| v.to_bits()).collect();
                    let b: Vec<u32> = one.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(a, b, "{dt:?} m={m} row {i}");
                }
            }
            let xs: Vec<Q8KRow> = (0..MAX_ROWS as u64)
                .map(|s| quantize_row_q8k(&pseudo(k, 70 + s)))
                .collect();
            let refs: Vec<&Q8KRow> = xs.iter().collect();
            let avx2 = crate::kernels::qmatmul::has_avx2();
            for j in 0..n {
                let bytes = w.row_bytes(j);
                let want: Vec<u32> = xs.iter().map(|x| vec_dot_portable(w.row(bytes), x).to_bits()).collect();
                for wide in [false, avx2 && has_avx512()] {
                    for g in 1..=MAX_ROWS {
                        let mut out = vec![0f32; g];
                        vec_dot_rows_with(w.row(bytes), &refs[..g], &mut out, avx2, wide, dt == GgmlDType::Q6K);
                        let got: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
                        assert_eq!(
                            got,
                            want[..g],
                            "{dt:?} row {j}: {g}-row kernel (wide {wide}) differs from portable"
                        );
                    }
                }
            }
        }
    }

    /// A weight matrix of raw super-blocks: random bytes, every fifth block all-zero quant bytes
    /// and every fifth all-0xFF (extreme quants, scales and mins), with finite f16 `d`/`dmin`.
    fn raw_weight(kind: KKind, n: usize, k: usize, seed: u64) -> KWeight {
        let bb = kind.block_bytes();
        let nblocks = n * k / QK_K;
        let mut st = seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1;
        let mut next = move || {
            st ^= st << 13;
            st ^= st >> 7;
            st ^= st << 17;
            st
        };
        let mut data = Vec::with_capacity(nblocks * bb);
        for blk in 0..nblocks {
            let start = data.len();
            for _ in 0..bb {
                data.push(match blk % 5 {
                    0 => 0x00,
                    1 => 0xFF,
                    _ => next() as u8,
                });
            }
            let f = |v: f32| f16::from_f32(v).to_bits().to_le_bytes();
            let d = f((next() % 2000) as f32 / 1000.0 - 1.0);
            let dmin = f((next() % 2000) as f32 / 1000.0 - 1.0);
            let b = &mut data[start..start + bb];
            match kind {
                KKind::Q2K => {
                    b[80..82].copy_from_slice(&d);
                    b[82..84].copy_from_slice(&dmin);
                }
                KKind::Q3K => b[108..110].copy_from_slice(&d),
                KKind::Q4K | KKind::Q5K => {
                    b[0..2].copy_from_slice(&d);
                    b[2..4].copy_from_slice(&dmin);
                }
                KKind::Q6K => b[208..210].copy_from_slice(&d),
            }
        }
        KWeight::from_blocks(kind, n, k, data)
    }

    /// Activation rows: random, zero, one huge value, all at ±amax, large and tiny magnitudes.
    fn raw_rows(m: usize, k: usize, seed: u64) -> Vec<f32> {
        let mut x = pseudo(m * k, seed);
        for (i, row) in x.chunks_exact_mut(k).enumerate() {
            match i % 6 {
                1 => row.iter_mut().for_each(|v| *v = 0.0),
                2 => row[k / 3] = -1e6,
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

    /// Every path (the wide VNNI or AVX2 tiles, the AVX2 / AVX-512 BW row kernels, the portable
    /// code) against
    /// the portable per-row reference, bit for bit, for m = 1..=33, odd weight row counts,
    /// 1..=3 super-blocks, on random and extreme weights and activations.
    #[test]
    fn all_paths_match_portable_bitwise() {
        use super::super::KernelPath;
        let kinds = [KKind::Q2K, KKind::Q3K, KKind::Q4K, KKind::Q5K, KKind::Q6K];
        for kind in kinds {
            for (n, nb) in [(7usize, 1usize), (5, 2), (3, 3)] {
                let k = nb * QK_K;
                let w = raw_weight(kind, n, k, 5 + n as u64);
                for m in 1..=33usize {
                    let x = raw_rows(m, k, 200 + m as u64);
                    let want: Vec<u32> = x
                        .chunks_exact(k)
                        .flat_map(|xr| {
                            let q = quantize_row_q8k(xr);
                            (0..n).map(move |j| (j, q.clone()))
                        })
                        .map(|(j, q)| vec_dot_portable(w.row(w.row_bytes(j)), &q).to_bits())
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

    /// llama.cpp's batch arithmetic (`with_llamacpp_batches`): Q4_K rows `..m - m % 4` and all
    /// Q6_K rows of an `m >= 8` product as the portable batch reference, the rest as the serving
    /// reference, on every path; and the arithmetics really differ (else the switch would test
    /// nothing).
    #[test]
    fn llamacpp_batches_match_portable_bitwise() {
        use super::super::KernelPath;
        let (n, nb) = (5usize, 3usize);
        let k = nb * QK_K;
        for kind in [KKind::Q4K, KKind::Q6K] {
            let w = raw_weight(kind, n, k, 11);
            let mut differ = 0;
            for m in 1..=13usize {
                let cut = match kind {
                    KKind::Q4K => m - m % 4,
                    _ if m >= 8 => m,
                    _ => 0,
                };
                let x = raw_rows(m, k, 300 + m as u64);
                let want: Vec<u32> = x
                    .chunks_exact(k)
                    .enumerate()
                    .flat_map(|(i, xr)| {
                        let q = quantize_row_q8k(xr);
                        (0..n).map(move |j| (i, j, q.clone()))
                    })
                    .map(|(i, j, q)| vec_dot_portable_with(w.row(w.row_bytes(j)), &q, i < cut).to_bits())
                    .collect();
                let serving: Vec<u32> = w
                    .matmul_on(&x, m, KernelPath::Best)
                    .iter()
                    .map(|v| v.to_bits())
                    .collect();
                differ += want.iter().zip(&serving).filter(|(a, b)| a != b).count();
                for path in [KernelPath::Best, KernelPath::Avx2, KernelPath::Portable] {
                    let got: Vec<u32> = with_llamacpp_batches(true, || w.matmul_on(&x, m, path))
                        .iter()
                        .map(|v| v.to_bits())
                        .collect();
                    assert_eq!(got, want, "{kind:?} m={m} {path:?}");
                }
            }
            assert!(
                differ > 0,
                "{kind:?}: the batch and serving arithmetics gave the same bits everywhere"
            );
        }
    }

    /// llama.cpp's own products, recorded (`scripts/llamacpp_kquant_dump.cpp`, files in
    /// `tests/fixtures/llamacpp-kquant/`): Q4_K from its repack buffer (gemv for 1 row, gemm for
    /// each 4 rows and gemv for the rest), Q6_K from the plain buffer (`vec_dot` below 8 rows,
    /// the tiled kernel from 8). A one-row product in serving's arithmetic, and every product
    /// under `with_llamacpp_batches`, must equal llama.cpp's bit for bit, on every path.
    #[test]
    fn matches_llamacpp_recorded_products() {
        use super::super::KernelPath;
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/llamacpp-kquant");
        for (name, kind) in [("q4k", KKind::Q4K), ("q6k", KKind::Q6K)] {
            for m in [1usize, 6, 9] {
                let path = dir.join(format!("{name}-m{m}.bin"));
                let b = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                let int = |i: usize| i32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]) as usize;
                let (n, k) = (int(0), int(1));
                assert_eq!(int(2), m, "{name}-m{m}: rows");
                let wl = n * k / QK_K * kind.block_bytes();
                let floats = |off: usize, cnt: usize| -> Vec<f32> {
                    b[off..off + 4 * cnt]
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect()
                };
                assert_eq!(b.len(), 12 + wl + 4 * m * k + 4 * m * n, "{name}-m{m}: file size");
                let w = KWeight::from_blocks(kind, n, k, b[12..12 + wl].to_vec());
                let x = floats(12 + wl, m * k);
                let want: Vec<u32> = floats(12 + wl + 4 * m * k, m * n).iter().map(|v| v.to_bits()).collect();
                let bits = |v: Vec<f32>| -> Vec<u32> { v.iter().map(|v| v.to_bits()).collect() };
                for path in [KernelPath::Best, KernelPath::Avx2, KernelPath::Portable] {
                    let got = bits(with_llamacpp_batches(true, || w.matmul_on(&x, m, path)));
                    assert_eq!(got, want, "{name}-m{m} {path:?}: llama.cpp's batch arithmetic");
                    // Serving's arithmetic is llama.cpp's one-row Q4_K and its tiled Q6_K.
                    if (kind == KKind::Q4K && m == 1) || (kind == KKind::Q6K && m == 9) {
                        assert_eq!(
                            bits(w.matmul_on(&x, m, path)),
                            want,
                            "{name}-m{m} {path:?}: serving arithmetic"
                        );
                    }
                }
            }
        }
    }

    /// Process CPU time in seconds (Linux), else wall time since the first call.
    use super::super::cpu_seconds;

    /// Our Q4_K / Q6_K product (wide VNNI or AVX2 tiles, and the AVX2 / AVX-512 BW row kernels) against
    /// candle's `QMatMul` on an 8960 × 1536 matrix (the 1.5B FFN shape), per row count: best of
    /// 3 process-CPU times. One thread, inside the pool as the model runs them:
    /// `cargo test --release -p specula-engine --lib kquants::tests::speed_vs_candle -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn speed_vs_candle() {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        pool.install(speed_vs_candle_in_pool);
    }

    fn speed_vs_candle_in_pool() {
        use super::super::KernelPath;
        let (n, k) = (8960, 1536);
        for dt in [GgmlDType::Q4K, GgmlDType::Q6K] {
            let (q, _) = weight(dt, n, k);
            let w = KWeight::from_qtensor(&q).unwrap().unwrap();
            let qm = QMatMul::from_qtensor(q).unwrap();
            for m in [1usize, 2, 4, 8, 9, 16, 64, 256] {
                let x = pseudo(m * k, 5);
                let xt = Tensor::from_vec(x.clone(), (m, k), &Device::Cpu).unwrap();
                let reps = if m >= 16 { 3 } else { 20 };
                let best = |f: &dyn Fn()| {
                    (0..3)
                        .map(|_| {
                            let t = cpu_seconds();
                            for _ in 0..reps {
                                f();
                            }
                            (cpu_seconds() - t) / reps as f64
                        })
                        .fold(f64::MAX, f64::min)
                };
                let ours = best(&|| {
                    std::hint::black_box(w.matmul_on(&x, m, KernelPath::Best));
                });
                let old = best(&|| {
                    std::hint::black_box(w.matmul_on(&x, m, KernelPath::Avx2));
                });
                let theirs = best(&|| {
                    std::hint::black_box(qm.forward(&xt).unwrap());
                });
                eprintln!(
                    "{dt:?} m={m:3}: ours {:7.3} ms, ours (avx2 path) {:7.3} ms, candle {:7.3} ms ({:.2}x)",
                    ours * 1e3,
                    old * 1e3,
                    theirs * 1e3,
                    ours / theirs
                );
            }
        }
    }

    /// One-row products on matrices larger than the L3 cache (weights streamed from memory),
    /// per path: `cargo test --release -p specula-engine --lib kquants::tests::speed_streamed -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn speed_streamed() {
        use super::super::KernelPath;
        for (dt, n, k) in [
            (GgmlDType::Q4K, 8960usize, 8960usize),
            (GgmlDType::Q6K, 32768, 1536),
            (GgmlDType::Q4K, 1536, 8960),
        ] {
            let w = KWeight::from_qtensor(&weight(dt, n, k).0).unwrap().unwrap();
            let copies: Vec<KWeight> = (0..4).map(|_| w.clone()).collect();
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
                    let gbs = (n * k / QK_K * w.kind.block_bytes()) as f64 / per / 1e9;
                    eprintln!("{dt:?} {n}x{k} m={m} {path:?}: {:.3} ms ({gbs:.1} GB/s)", per * 1e3);
                }
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_k4_scales_match_scalar() {
        if !super::super::has_avx512_vnni() {
            return;
        }
        let mut st = 777u32;
        for _ in 0..300 {
            let bytes: Vec<u8> = (0..32)
                .map(|_| {
                    st = st.wrapping_mul(1_103_515_245).wrapping_add(12345);
                    (st >> 16) as u8
                })
                .collect();
            // SAFETY: AVX-512 VNNI (with AVX2) was detected; 16 bytes are readable at each pointer.
            let (a, b, m2) = unsafe { avx2_impl::k4_scales2_for_test(bytes.as_ptr(), bytes[16..].as_ptr()) };
            for (h, off) in [(0usize, 0usize), (1, 16)] {
                let want = scales_mins_k4(&bytes[off..off + 12]);
                let sc = if h == 0 { &a } else { &b };
                let sc_want: Vec<i16> = want[..8].iter().map(|&v| v as i16).collect();
                let m_want: Vec<i16> = want[8..].iter().map(|&v| v as i16).collect();
                assert_eq!(&sc[..8], &sc_want[..], "scales {h}");
                assert_eq!(&m2[8 * h..8 * h + 8], &m_want[..], "mins {h}");
            }
        }
    }

    #[test]
    fn k4_scales_match_get_scale_min_k4() {
        let mut st = 12345u32;
        for _ in 0..200 {
            let s: Vec<u8> = (0..12)
                .map(|_| {
                    st = st.wrapping_mul(1_103_515_245).wrapping_add(12345);
                    (st >> 16) as u8
                })
                .collect();
            let got = scales_mins_k4(&s);
            for j in 0..8 {
                let (sc, m) = if j < 4 {
                    (s[j] & 63, s[j + 4] & 63)
                } else {
                    (
                        (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
                        (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
                    )
                };
                assert_eq!((got[j], got[8 + j]), (sc, m), "sub-block {j} of {s:?}");
            }
        }
    }

    #[test]
    fn q8k_quantization_matches_ggml_definition() {
        let mut x = vec![0f32; 2 * QK_K];
        // Block 0: the first value of largest magnitude is negative (-2.0; a later +2.0 does
        // not replace it), so iscale = -127 / -2 = 63.5 and d = 1 / 63.5.
        x[0] = 0.5; // 31.75 -> 32
        x[1] = -2.0; // -127
        x[2] = 2.0; // 127
        x[3] = 1.0 / 127.0; // 0.5 -> 0 (ties to even)
        x[4] = 3.0 / 127.0; // 1.5 -> 2
        x[5] = 5.0 / 127.0; // 2.5 -> 2
        x[17] = -1.0; // -63.5 -> -64 (ties to even), in the second group of 16
                      // Block 1 stays zero.
        let q = quantize_row_q8k(&x);
        let iscale = -127.0f32 / -2.0;
        assert_eq!(q.d[0].to_bits(), (1.0f32 / iscale).to_bits());
        let want: Vec<i8> = x[..6].iter().map(|&v| (iscale * v).round_ties_even() as i8).collect();
        assert_eq!(&q.qs[..6], &want[..]);
        assert_eq!(&q.qs[..6], &[32, -127, 127, 0, 2, 2]);
        assert_eq!(q.qs[17], -64);
        assert_eq!(q.bsums[0], 32 - 127 + 127 + 2 + 2);
        assert_eq!(q.bsums[1], -64);
        assert!(q.bsums[2..16].iter().all(|&s| s == 0));
        assert_eq!(q.d[1], 0.0);
        assert!(q.qs[QK_K..].iter().all(|&v| v == 0));
        assert!(q.bsums[16..].iter().all(|&s| s == 0));
        // Positive maximum: iscale negative, quants flip sign (as in ggml).
        let mut y = vec![0f32; QK_K];
        y[7] = 4.0;
        y[8] = -1.0;
        let q = quantize_row_q8k(&y);
        assert_eq!(q.qs[7], -127);
        assert_eq!(q.qs[8], 32); // -31.75 * -1 -> 31.75 -> 32
        assert_eq!(q.d[0], 1.0 / (-127.0f32 / 4.0));
        assert!(q.d[0] < 0.0);
    }
}
