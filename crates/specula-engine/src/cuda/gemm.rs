//! GEMM selection: which tensor-core kernel and tile a product of a given row count runs on
//! (every choice gives the same bits; the fold order depends on K only).

use super::*;

impl Gpu {
    /// Y[rows, n] = X[rows, k] · W[n, k]ᵀ (+ R): W a [`Mat`] given as its (values, scales)
    /// addresses (scales 0: bf16), X bf16 `[rows, k]`, Y and R f32 `[rows, n]` (R may be Y).
    /// Batch-invariant for any `rows` (kernels.cu says how). Errors: a Q8_0 matrix on the
    /// reference GEMV path, or a launch failure.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm(
        &self,
        w: (u64, u64),
        x: u64,
        r: Option<u64>,
        y: u64,
        rows: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        self.gemm_epi(w, x, r, y, rows, n, k, Epilogue::Plain)
    }

    /// [`Gpu::gemm`] with a fused [`Epilogue`]. Errors: as `gemm`; a fused epilogue on the
    /// reference GEMV path; `SiluMul` with a residual or `n` not a multiple of 16.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemm_epi(
        &self,
        w: (u64, u64),
        x: u64,
        r: Option<u64>,
        y: u64,
        rows: usize,
        n: usize,
        k: usize,
        epi: Epilogue,
    ) -> Result<()> {
        if self.gemm_path.get() == GemmPath::Gemv {
            if w.1 != 0 {
                bail!("the reference GEMV kernels take bf16 weights only");
            }
            if epi != Epilogue::Plain {
                bail!("the reference GEMV kernels have no fused epilogue");
            }
            return self.gemv(w.0, x, r, y, rows, n, k);
        }
        if !k.is_multiple_of(8) {
            bail!("the GEMM needs K a multiple of 8 (16-byte loads), got {k}");
        }
        let act = match epi {
            Epilogue::Plain => 0,
            Epilogue::SiluMul { act } => {
                if r.is_some() || !n.is_multiple_of(16) {
                    bail!("the SiLU epilogue needs no residual and n a multiple of 16 (got {n})");
                }
                act
            }
        };
        let silu = act != 0;
        let q8 = w.1 != 0;
        if self.profile.borrow().is_some() {
            let e = if silu { " +silu" } else { "" };
            *self.profile_tag.borrow_mut() = format!("gemm n{n} k{k}{e}");
        }
        let wide = self.wide.get();
        if rows > 32 && matches!(wide, Wide::Seq | Wide::Seq32) {
            let half = wide == Wide::Seq32;
            let rt = if half { 32 } else { 64 };
            let tiles = rows.div_ceil(rt) * n.div_ceil(128);
            let mut ks = 1;
            while tiles * ks < self.seq_blocks.get() && ks < 8 && tiles <= SEQ_MAX_TILES {
                ks *= 2;
            }
            let kind = match (half, self.seq_w.get()) {
                (true, _) => 1,
                (false, SeqWeights::Reg4) => 0,
                (false, SeqWeights::Reg6) => 2,
                (false, SeqWeights::Ring) => 3,
            };
            let name = GEMM_SEQ[kind][silu as usize][q8 as usize];
            return self.launch3(
                name,
                (rows.div_ceil(rt) as u32, n.div_ceil(128) as u32, ks as u32),
                256,
                GEMM_SEQ_SMEM[kind],
                &[
                    A::P(w.0),
                    A::P(w.1),
                    A::P(x),
                    A::P(r.unwrap_or(0)),
                    A::P(y),
                    A::I(rows as i32),
                    A::I(n as i32),
                    A::I(k as i32),
                    A::P(act),
                    A::P(self.seq_part.at(0)),
                    A::P(self.seq_count.at(0)),
                ],
            );
        }
        let (mt, nt) = gemm_tile(rows, if wide == Wide::Tile4 { 4 } else { 2 });
        let narrow = (mt, nt) == (2, 8)
            && rows <= 64
            && self.narrow64.get()
            && self.pipe.get() > 0
            && n.div_ceil(32) <= self.sms;
        let (mt, nt) = if narrow { (2, 4) } else { (mt, nt) };
        // Feature groups a block (the `_pp` kind: 2).
        let mut groups = 1;
        let (name, smem) = match self.pipe.get() {
            _ if narrow => (GEMM_PX24[silu as usize][q8 as usize], GEMM_PX24_SMEM),
            p if p > 0 && (mt, nt) == (2, 8) => {
                let blocks = rows.div_ceil(64) * n.div_ceil(32);
                let kind = match p {
                    PIPE_AUTO if !q8 && rows.div_ceil(64) * n.div_ceil(64) >= self.sms => PIPE_PP,
                    PIPE_AUTO if !q8 && blocks > self.sms => 3,
                    PIPE_AUTO => 1,
                    p => p as usize - 1,
                };
                if kind == PIPE_PP {
                    groups = 2;
                }
                (GEMM_PIPE[kind][silu as usize][q8 as usize], GEMM_PIPE_SMEM[kind])
            }
            _ if mt == 1 && nt >= self.db_from_nt.get() => (GEMM_DB[silu as usize][q8 as usize][nt - 1], 0),
            _ => (
                GEMM_NAMES[silu as usize][q8 as usize]
                    .iter()
                    .find(|(m, t, _)| (*m, *t) == (mt, nt))
                    .map(|e| e.2)
                    .ok_or_else(|| anyhow::anyhow!("no GEMM kernel for a {mt}x{nt} tile"))?,
                0,
            ),
        };
        self.launch_smem(
            name,
            (rows.div_ceil(8 * nt) as u32, n.div_ceil(16 * mt * groups) as u32),
            256 * groups as u32,
            smem,
            &[
                A::P(w.0),
                A::P(w.1),
                A::P(x),
                A::P(r.unwrap_or(0)),
                A::P(y),
                A::I(rows as i32),
                A::I(n as i32),
                A::I(k as i32),
                A::P(act),
            ],
        )
    }

    /// The reference path: chunks of up to 16 rows on the `gemv_m{M}` FMA kernels.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn gemv(&self, w: u64, x: u64, r: Option<u64>, y: u64, rows: usize, n: usize, k: usize) -> Result<()> {
        let mut c = 0;
        while c < rows {
            let m = (rows - c).min(16);
            let yo = y + (c * n * 4) as u64;
            let ro = r.map(|p| p + (c * n * 4) as u64).unwrap_or(0);
            self.launch(
                KERNELS[m - 1],
                ((n as u32).div_ceil(16), 1),
                256,
                &[
                    A::P(w),
                    A::P(x + (c * k * 2) as u64),
                    A::P(ro),
                    A::P(yo),
                    A::I(n as i32),
                    A::I(k as i32),
                ],
            )?;
            c += m;
        }
        Ok(())
    }
}

/// The (MT, NT) tile of the GEMM for `rows` input rows: 16·MT features by 8·NT rows per block.
/// Any choice gives the same bits (the fold order depends on K only); this one is for speed.
pub(crate) fn gemm_tile(rows: usize, wide_mt: usize) -> (usize, usize) {
    match rows {
        0..=8 => (1, 1),
        9..=16 => (1, 2),
        17..=32 => (2, 4),
        _ => (wide_mt, 8),
    }
}

/// The GEMM above 32 rows (kernels.cu; every choice gives the same bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wide {
    /// `gemm_*_2x8` (32 features x 64 rows a block, the 8 K slices in its 8 warps), with its
    /// weights and X through a cp.async ring ([`Gpu::pipe`]) unless `SPECULA_CUDA_GEMM_PIPE=0`.
    Tile2,
    /// `gemm_*_4x8` (64 features a block, one chunk of weights in flight).
    Tile4,
    /// `gemm_seq_*` (128 features x 64 rows a block, each warp walking the K slices in order,
    /// the X chunks shared through shared memory; narrow layers split the slices over blocks).
    Seq,
    /// `gemm_seq32_*`: the same with 32 rows a block (two blocks a multiprocessor).
    Seq32,
}

impl Wide {
    pub fn name(self) -> &'static str {
        match self {
            Wide::Tile2 => "2x8",
            Wide::Tile4 => "4x8",
            Wide::Seq => "seq",
            Wide::Seq32 => "seq32",
        }
    }
}

/// How the 64-row `gemm_seq` tile keeps weights in flight (kernels.cu, `gemm_seq_impl`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqWeights {
    /// Two alternating register batches of 4 chunks (`gemm_seq`).
    Reg4,
    /// Two register batches of 6 chunks (`gemm_seq6`).
    Reg6,
    /// A cp.async ring in shared memory with X, 14 chunks ahead (`gemm_seqw`).
    Ring,
}

impl SeqWeights {
    pub fn name(self) -> &'static str {
        match self {
            SeqWeights::Reg4 => "4",
            SeqWeights::Reg6 => "6",
            SeqWeights::Ring => "ring",
        }
    }
}

/// The `gemm_seq` kernels: `[kind][silu][q8]`, kind 0: 64 rows, 1: 32 rows, 2: 64 rows with 12
/// chunks of weights in flight a warp (not 8), 3: 64 rows with the weights in a shared-memory
/// ring.
pub(crate) const GEMM_SEQ: [[[&str; 2]; 2]; 4] = [
    [
        ["gemm_seq_bf16", "gemm_seq_q8"],
        ["gemm_seq_bf16_silu", "gemm_seq_q8_silu"],
    ],
    [
        ["gemm_seq32_bf16", "gemm_seq32_q8"],
        ["gemm_seq32_bf16_silu", "gemm_seq32_q8_silu"],
    ],
    [
        ["gemm_seq6_bf16", "gemm_seq6_q8"],
        ["gemm_seq6_bf16_silu", "gemm_seq6_q8_silu"],
    ],
    [
        ["gemm_seqw_bf16", "gemm_seqw_q8"],
        ["gemm_seqw_bf16_silu", "gemm_seqw_q8_silu"],
    ],
];

/// Dynamic shared memory of each kind of `gemm_seq` kernel: the X ring, 4 stages of U chunks
/// of (rows x 64 bytes); kind 3: 8 stages of 2 chunks of X and weights (256 lanes x 32 bytes).
pub(crate) const GEMM_SEQ_SMEM: [u32; 4] = [
    4 * 4 * 64 * 64,
    4 * 4 * 32 * 64,
    4 * 6 * 64 * 64,
    8 * 2 * (64 * 64 + 256 * 32),
];

/// Feature x row tiles (128 x 64) a `gemm_seq` launch may split over blocks (the partials
/// buffer holds this many); launches with more tiles do not split.
pub const SEQ_MAX_TILES: usize = 256;

/// Bytes of slice partials per tile: 8 slices x 128 features x 64 rows x f32.
pub(crate) const SEQ_TILE_PART_BYTES: usize = 8 * 128 * 64 * 4;

/// The default of [`Gpu::seq_blocks`] (132 multiprocessors on an H200).
pub(crate) const SEQ_BLOCKS: usize = 128;

/// Where a GEMM's outputs go (kernels.cu, above `gemm_impl`). Each output keeps its fold, so
/// the SiLU epilogue gives the bits of the `silu_mul` kernel it replaces.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Epilogue {
    /// Write Y (+ R).
    Plain,
    /// The gate/up GEMM (rows interleaved in groups of 8, `cuda::load`): write `act` (bf16
    /// `[rows, n / 2]`) = SiLU(gate) · up, as the `silu_mul` kernel, and not Y.
    SiluMul { act: u64 },
}

/// The 2x8 tile with its operands streamed through a cp.async ring in shared memory (kernels.cu;
/// the same bits as `gemm_*_2x8`), `[kind][silu][q8]`: kind 0 the weights (`_pipe`), 1..3 the
/// weights and X (`_px`: 3 stages, `_px4`: 4, `_px2`: 2 and two blocks a multiprocessor), 4
/// `_pp`: two feature groups a block sharing X (512 threads, 64 features, 3 stages).
pub(crate) const GEMM_PIPE: [[[&str; 2]; 2]; 5] = [
    [
        ["gemm_bf16_2x8_pipe", "gemm_q8_2x8_pipe"],
        ["gemm_bf16_2x8_pipe_silu", "gemm_q8_2x8_pipe_silu"],
    ],
    [
        ["gemm_bf16_2x8_px", "gemm_q8_2x8_px"],
        ["gemm_bf16_2x8_px_silu", "gemm_q8_2x8_px_silu"],
    ],
    [
        ["gemm_bf16_2x8_px4", "gemm_q8_2x8_px4"],
        ["gemm_bf16_2x8_px4_silu", "gemm_q8_2x8_px4_silu"],
    ],
    [
        ["gemm_bf16_2x8_px2", "gemm_q8_2x8_px2"],
        ["gemm_bf16_2x8_px2_silu", "gemm_q8_2x8_px2_silu"],
    ],
    [
        ["gemm_bf16_2x8_pp", "gemm_q8_2x8_pp"],
        ["gemm_bf16_2x8_pp_silu", "gemm_q8_2x8_pp_silu"],
    ],
];

/// The [`GEMM_PIPE`] kind of the `_pp` kernels.
pub(crate) const PIPE_PP: usize = 4;

/// The 2x4 tile with its operands through a 3-stage ring (`gemm_*_2x4_px`), `[silu][q8]`.
pub(crate) const GEMM_PX24: [[&str; 2]; 2] = [
    ["gemm_bf16_2x4_px", "gemm_q8_2x4_px"],
    ["gemm_bf16_2x4_px_silu", "gemm_q8_2x4_px_silu"],
];

/// Dynamic shared memory of [`GEMM_PX24`]: 3 stages x (2 m-tiles x 2 rows + 4 n-tiles) x 256
/// lanes x 16 bytes.
pub(crate) const GEMM_PX24_SMEM: u32 = 3 * 8 * 256 * 16;

/// `SPECULA_CUDA_GEMM_PIPE`'s names of [`Gpu::pipe`]'s values.
pub const PIPE_NAMES: [&str; 7] = ["0", "w", "px", "px4", "px2", "pp", "auto"];

/// [`Gpu::pipe`]'s default: on the H200 (qwen3-8b bf16, 64 rows) `_px2` ran the
/// layers of many blocks fastest (gate/up 3.22 ms a step against 3.50 with `_px` and 3.75 with
/// `_pipe`; QKV 1.07, 1.16, 1.28) and `_px` those of at most one block a multiprocessor (down
/// 1.81 against 2.06 with `_px2` and 2.01 with `_pipe`; o 0.87, 0.89, 0.94). With Q8_0 weights
/// `_px` was fastest for every layer (64 rows: 10.06 ms a step against 12.37 with `_px2`).
/// Measured again in the same call: `_pp` for the bf16 layers whose `_pp` grid
/// has at least a block a multiprocessor (gate/up 3.07 ms against 3.21 with `_px2`, LM head
/// 0.44 against 0.49; 64 streams 7,833 against 7,613 tok/s); down, o and QKV slower with it
/// (2.46, 1.15, 1.11 ms against 1.80, 0.88, 1.08). With Q8_0 weights `_pp` lost (64 streams
/// 6,279 against 7,057 with `_px`).
pub const PIPE_AUTO: u8 = 6;

/// Dynamic shared memory of each [`GEMM_PIPE`] kind: stages x chunks a stage x (2 m-tiles x 2
/// rows of weights + 8 n-tiles of X) x 256 lanes x 16 bytes; `_pp`: 3 stages x (2 groups x 4
/// rows of weights + 8 n-tiles of X) x 256 lanes x 16 bytes.
pub(crate) const GEMM_PIPE_SMEM: [u32; 5] = [
    3 * 2 * 4 * 256 * 16,
    3 * 12 * 256 * 16,
    4 * 12 * 256 * 16,
    2 * 12 * 256 * 16,
    3 * 16 * 256 * 16,
];

/// The GEMM kernel of each (MT, NT) tile.
pub(crate) type GemmTiles = [(usize, usize, &'static str); 5];

/// The 1x1 and 1x2 tiles with two alternating register batches (`Gpu::db_from_nt`):
/// [silu][q8][nt - 1].
pub(crate) const GEMM_DB: [[[&str; 2]; 2]; 2] = [
    [
        ["gemm_bf16_1x1_db", "gemm_bf16_1x2_db"],
        ["gemm_q8_1x1_db", "gemm_q8_1x2_db"],
    ],
    [
        ["gemm_bf16_1x1_silu_db", "gemm_bf16_1x2_silu_db"],
        ["gemm_q8_1x1_silu_db", "gemm_q8_1x2_silu_db"],
    ],
];

/// GEMM kernels by (MT, NT): plain, then with the SiLU epilogue (`_silu`); each bf16, then
/// Q8_0.
pub(crate) const GEMM_NAMES: [[GemmTiles; 2]; 2] = [
    [
        [
            (1, 1, "gemm_bf16_1x1"),
            (1, 2, "gemm_bf16_1x2"),
            (2, 4, "gemm_bf16_2x4"),
            (2, 8, "gemm_bf16_2x8"),
            (4, 8, "gemm_bf16_4x8"),
        ],
        [
            (1, 1, "gemm_q8_1x1"),
            (1, 2, "gemm_q8_1x2"),
            (2, 4, "gemm_q8_2x4"),
            (2, 8, "gemm_q8_2x8"),
            (4, 8, "gemm_q8_4x8"),
        ],
    ],
    [
        [
            (1, 1, "gemm_bf16_1x1_silu"),
            (1, 2, "gemm_bf16_1x2_silu"),
            (2, 4, "gemm_bf16_2x4_silu"),
            (2, 8, "gemm_bf16_2x8_silu"),
            (4, 8, "gemm_bf16_4x8_silu"),
        ],
        [
            (1, 1, "gemm_q8_1x1_silu"),
            (1, 2, "gemm_q8_1x2_silu"),
            (2, 4, "gemm_q8_2x4_silu"),
            (2, 8, "gemm_q8_2x8_silu"),
            (4, 8, "gemm_q8_4x8_silu"),
        ],
    ],
];
