//! The forward: weights and KV cache on the device, one step enqueued kernel by kernel, CUDA
//! graphs per row count, and the [`crate::device::DeviceTarget`] contract.

use super::*;

impl Gpu {
    /// Y[r, :] = bf16(RMSNorm(X[r, :]) · w) for `rows` rows of width `h` (f32 in, bf16 out).
    pub(crate) fn rmsnorm(&self, x: u64, w: u64, y: u64, rows: usize, h: usize, eps: f32) -> Result<()> {
        self.launch(
            "rmsnorm_bf16",
            (rows as u32, 1),
            256,
            &[A::P(x), A::P(w), A::P(y), A::I(h as i32), A::F(eps)],
        )
    }
}

/// One layer's weights on the device.
pub(crate) struct Layer {
    pub attn_norm: DevBuf,
    /// `[q; k; v]` rows: `[(heads + 2 kv_heads) head_dim, hidden]`.
    pub qkv: Mat,
    /// f32 `[(heads + 2 kv_heads) head_dim]` (Qwen2).
    pub qkv_bias: Option<DevBuf>,
    pub q_norm: Option<DevBuf>,
    pub k_norm: Option<DevBuf>,
    pub o: Mat,
    pub mlp_norm: DevBuf,
    pub mlp: LayerMlp,
}

/// One layer's MLP on the device.
pub(crate) enum LayerMlp {
    /// `gate_up`: the `[gate; up]` rows interleaved in groups of 8, `[2 intermediate, hidden]`;
    /// `down`: `[hidden, intermediate]`.
    Dense {
        gate_up: Mat,
        down: Mat,
    },
    Moe(MoeLayer),
}

/// An MoE layer's weights (bf16).
pub(crate) struct MoeLayer {
    pub experts: usize,
    /// The router's `[experts, hidden]` rows, then the shared expert's gate row when there is
    /// one: `[experts (+ 1), hidden]`.
    pub router: Mat,
    /// Per expert its gate rows, then its up rows: `[experts, 2 expert_intermediate, hidden]`
    /// (bf16, or Q8_0 values with their scales).
    pub gate_up: Mat,
    /// `[experts, hidden, expert_intermediate]`.
    pub down: Mat,
    /// The shared expert: `[gate; up]` interleaved as a dense MLP's, and its down.
    pub shared: Option<(Mat, Mat)>,
}

impl LayerMlp {
    /// Bytes of every weight; with `active`, a one-row step's: the router, the shared expert
    /// and `top_k` of the experts.
    fn bytes(&self, active: Option<usize>) -> usize {
        match self {
            LayerMlp::Dense { gate_up, down } => gate_up.bytes() + down.bytes(),
            LayerMlp::Moe(m) => {
                let shared = m.shared.as_ref().map_or(0, |(a, b)| a.bytes() + b.bytes());
                let experts = m.gate_up.bytes() + m.down.bytes();
                let experts = match active {
                    Some(k) => experts / m.experts.max(1) * k,
                    None => experts,
                };
                m.router.bytes() + shared + experts
            }
        }
    }
}

/// All weights on the device.
pub(crate) struct Weights {
    pub embed: DevBuf,
    /// None: tied to the embedding.
    pub lm_head: Option<Mat>,
    pub final_norm: DevBuf,
    pub layers: Vec<Layer>,
}

impl Weights {
    /// Bytes of every weight (each matrix and norm, the embedding, and the LM head when it is
    /// not tied): the floor's numerator, as the issue and `scripts/gpu_torch_baseline.py` count
    /// it. A decode step reads one row of the embedding, so the strict floor is a little lower
    /// (docs/gpu.md gives both).
    pub fn bytes(&self) -> usize {
        self.bytes_with(None)
    }

    /// [`Weights::bytes`] with only `top_k` experts of each MoE layer counted: what a one-row
    /// step reads (the floor's numerator on an MoE model). The same as `bytes` on a dense one.
    pub fn step_bytes(&self, top_k: usize) -> usize {
        self.bytes_with(Some(top_k))
    }

    fn bytes_with(&self, active: Option<usize>) -> usize {
        let mut b = self.final_norm.bytes() + self.embed.bytes();
        if let Some(h) = &self.lm_head {
            b += h.bytes();
        }
        for l in &self.layers {
            b += l.attn_norm.bytes() + l.qkv.bytes() + l.o.bytes() + l.mlp_norm.bytes() + l.mlp.bytes(active);
            for x in [&l.qkv_bias, &l.q_norm, &l.k_norm].into_iter().flatten() {
                b += x.bytes();
            }
        }
        b
    }
}

/// Which rows of a forward get logits.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum LogitsRows {
    None,
    Last,
    All,
}

/// One input row: the token, the KV slot of its sequence, and its position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Row {
    pub token: u32,
    pub slot: u32,
    pub pos: u32,
}

/// What a forward returns: per logits row, the greedy token and (when asked) the f32 logits,
/// `[rows, vocab]` row-major.
#[derive(Debug, Clone, Default)]
pub struct StepOut {
    pub argmax: Vec<u32>,
    pub logits: Vec<f32>,
}

pub(crate) struct Scratch {
    pub(crate) x: DevBuf,
    pub(crate) xn: DevBuf,
    pub(crate) qkv: DevBuf,
    pub(crate) q: DevBuf,
    pub(crate) ao: DevBuf,
    pub(crate) gu: DevBuf,
    pub(crate) act: DevBuf,
    pub(crate) logits: DevBuf,
    pub(crate) scores: DevBuf,
    pub(crate) argmax: DevBuf,
    /// f32 `[MAX_ROWS, heads, ATT_SPLITS, head_dim + 2]`: the attention's per-range partials.
    pub(crate) att_part: DevBuf,
    /// i32 `[MAX_ROWS, heads]`: ranges finished per row and head (zero between launches).
    pub(crate) att_count: DevBuf,
    /// i32 `[3, MAX_ROWS]`: tokens, positions, slots.
    pub(crate) io: DevBuf,
    /// The MoE layers' buffers (an MoE model only).
    pub(crate) moe: Option<MoeScratch>,
}

/// Scratch of the MoE layers, for up to MAX_ROWS rows of `top_k` pairs each.
pub(crate) struct MoeScratch {
    /// f32 `[MAX_ROWS, experts (+ 1)]`: router logits (and the shared expert's gate logit).
    pub router: DevBuf,
    /// i32 / f32 `[MAX_ROWS, top_k]`: each row's experts by rank and their weights.
    pub ids: DevBuf,
    pub wts: DevBuf,
    /// i32 `[experts + 1]` and `[MAX_ROWS · top_k]`: the pairs of each expert (`moe_plan`).
    pub off: DevBuf,
    pub pairs: DevBuf,
    /// bf16 `[MAX_ROWS · top_k, expert_intermediate]`: SiLU(gate) · up per pair.
    pub act: DevBuf,
    /// f32 `[MAX_ROWS · top_k, hidden]`: each pair's expert output.
    pub y: DevBuf,
    /// f32 `[MAX_ROWS, hidden]`: the shared expert's output.
    pub shared: DevBuf,
}

/// Kernel choices of `GpuModel::enqueue`, from the environment (speed only: the same bits).
#[derive(Clone, Debug)]
pub(crate) struct KernelOptions {
    /// The gate/up GEMM writes SiLU(gate) · up itself ([`Epilogue::SiluMul`]);
    /// `SPECULA_CUDA_FUSE_SILU=0` launches `silu_mul` instead.
    pub silu: bool,
    /// `attention_rows_deep` (more loads in flight, fewer blocks per SM) or `attention_rows`:
    /// None picks by row count (deep up to [`ATT_DEEP_ROWS`]); `SPECULA_CUDA_ATT=deep|normal`
    /// forces one. The same bits either way.
    pub att_deep: Option<bool>,
    /// Query heads per block of the many-row attention kernel: 4 (those of one KV head share
    /// its K/V loads) where the model has a multiple of 4 per KV head, unless
    /// `SPECULA_CUDA_ATT_GROUP` is below 4 (one per block).
    pub att_group: usize,
    /// Forwards of up to [`ATT_DEEP_ROWS`] rows, all of different sequences, do
    /// `qkv_rope_store`'s work in the attention kernel (`attention_rope_rows_deep`);
    /// `SPECULA_CUDA_FUSE_ROPE=0` launches it separately for every forward.
    pub rope: bool,
    /// `SPECULA_CUDA_FUSE_ROPE=wide`: the grouped attention's widths too
    /// (`attention_rope_rows_g4_b4`). Off by default: on the H200 (qwen3-8b bf16)
    /// 64 streams ran at 8,036 / 8,012 tok/s with it and 8,072 without, in one call.
    pub rope_wide: bool,
    /// Launch the attention with the key-range index as the slowest grid dimension, so the
    /// blocks of a short row's empty ranges are dispatched after the working ones
    /// (`SPECULA_CUDA_ATT_ORDER=range`; speed only).
    pub att_range_last: bool,
    /// The grouped attention kernel: compiled for 2 blocks a multiprocessor
    /// (`attention_rows_g4`), 3 or 4 (`_b3`, `_b4`: fewer registers); at 4 without the L2
    /// prefetch of its K / V lines (the default), with it (`_pf`), or with 4 key passes (32 keys
    /// each) loaded at once instead of 2 (`_k4`); `SPECULA_CUDA_ATT_G4=2|3|4|4k4|4pf` (speed
    /// only). On the H200 (qwen3-8b bf16, 64 rows at context 128) 4 blocks took the
    /// attention to 1.23 ms a step against 1.49 with 2 and 1.54 with 3.
    pub att_g4: &'static str,
    /// The same kernel with the RoPE / KV write inside (`attention_rope_rows_g4_b4[_k4]`), where
    /// it has one; used with [`KernelOptions::rope_wide`].
    pub att_g4_rope: Option<&'static str>,
    /// Timing experiments only (wrong outputs): kernels left out of every forward,
    /// `SPECULA_CUDA_SKIP=norm,rope,attn,silu` (any of them).
    pub skip: Vec<String>,
}

/// The grouped attention kernel runs when it has at least this many blocks (H200, qwen3-8b:
/// 64 streams 6,392 -> 6,499 tok/s and 8k prefill 1,669 -> 1,880 with it, 16 streams 2,851 ->
/// 2,760: at 16 rows its 128 blocks leave most SMs idle). Groups of 2 (qwen3-0.6b / 1.7b, 2 query
/// heads per KV head) were slower: 0.90 against 0.75 ms of attention at 64 rows.
pub(crate) const ATT_GROUP_MIN_BLOCKS: usize = 256;

/// Forwards of up to this many rows run `attention_rows_deep`: on the H200 (qwen3-8b, context
/// 128) it took batch-1 decode from 211.6 to 214.1 tok/s and 64 streams from 6,404 to 6,116.
pub(crate) const ATT_DEEP_ROWS: usize = 4;

impl KernelOptions {
    pub(crate) fn from_env() -> Result<Self> {
        let on = |var: &str| std::env::var(var).map_or(true, |v| v != "0");
        let (silu, rope) = (on("SPECULA_CUDA_FUSE_SILU"), on("SPECULA_CUDA_FUSE_ROPE"));
        let rope_wide = std::env::var("SPECULA_CUDA_FUSE_ROPE").is_ok_and(|v| v == "wide");
        let skip: Vec<String> = std::env::var("SPECULA_CUDA_SKIP")
            .map(|v| v.split(',').filter(|k| !k.is_empty()).map(str::to_string).collect())
            .unwrap_or_default();
        let att_deep = match std::env::var("SPECULA_CUDA_ATT").as_deref() {
            Err(_) | Ok("auto") => None,
            Ok("deep") => Some(true),
            Ok("normal") => Some(false),
            Ok(v) => bail!("SPECULA_CUDA_ATT={v}: use auto, deep or normal"),
        };
        let att_group = match std::env::var("SPECULA_CUDA_ATT_GROUP") {
            Err(_) => 4,
            Ok(v) => v
                .parse()
                .map_err(|_| anyhow::anyhow!("SPECULA_CUDA_ATT_GROUP={v}: use 1 or 4"))?,
        };
        let (att_g4, att_g4_rope) = match std::env::var("SPECULA_CUDA_ATT_G4").as_deref() {
            Ok("2") => ("attention_rows_g4", None),
            Ok("3") => ("attention_rows_g4_b3", None),
            Err(_) | Ok("4") => ("attention_rows_g4_b4", Some("attention_rope_rows_g4_b4")),
            Ok("4k4") => ("attention_rows_g4_b4_k4", Some("attention_rope_rows_g4_b4_k4")),
            Ok("4pf") => ("attention_rows_g4_b4_pf", None),
            Ok(v) => bail!("SPECULA_CUDA_ATT_G4={v}: use 2, 3, 4, 4k4 or 4pf"),
        };
        if !skip.is_empty() {
            tracing::warn!(
                "SPECULA_CUDA_SKIP={skip:?}: those kernels are left out, every output is wrong (timing only)"
            );
        }
        Ok(Self {
            silu,
            rope,
            rope_wide,
            att_group,
            att_deep,
            att_range_last: std::env::var("SPECULA_CUDA_ATT_ORDER").is_ok_and(|v| v == "range"),
            att_g4,
            att_g4_rope,
            skip,
        })
    }

    pub(crate) fn skips(&self, kernel: &str) -> bool {
        self.skip.iter().any(|k| k == kernel)
    }
}

pub(crate) struct Kv {
    pub(crate) k: DevBuf,
    pub(crate) v: DevBuf,
    pub(crate) slots: usize,
    pub(crate) max_ctx: usize,
}

pub(crate) struct Graph {
    pub(crate) graph: sys::CUgraph,
    pub(crate) exec: sys::CUgraphExec,
}

impl Drop for Graph {
    fn drop(&mut self) {
        unsafe {
            sys::cuGraphExecDestroy(self.exec);
            sys::cuGraphDestroy(self.graph);
        }
    }
}

/// A model on the GPU with its KV slots.
pub struct GpuModel {
    pub config: GpuConfig,
    pub(crate) w: Weights,
    pub(crate) inv_freq: DevBuf,
    pub(crate) s: Scratch,
    pub(crate) kv: Kv,
    /// Captured graphs by (rows, whether every row is of another sequence).
    pub(crate) graphs: HashMap<(usize, bool), Graph>,
    /// Per slot: positions written by [`crate::device::DeviceTarget::forward`] (the engine's
    /// contract: a row's position is at most its slot's written length, so it never attends
    /// stale K/V).
    pub(crate) written: Vec<u32>,
    /// Use captured graphs for narrow forwards (on by default; `SPECULA_CUDA_GRAPHS=0` turns
    /// them off).
    pub use_graphs: bool,
    /// Kernel choices (from the environment; speed only).
    pub(crate) kernels: KernelOptions,
    /// Hidden-state taps of the forward being enqueued: after block `layer`, the residual
    /// stream's rows are copied to the device address (set by `forward_hidden` only).
    pub(crate) tap_dst: Vec<(usize, u64)>,
    /// Where those copies go: `taps × MAX_ROWS × hidden` f32, grown on demand.
    pub(crate) tap_buf: Option<DevBuf>,
    /// Last: fields drop in order, and graphs and buffers must go while the context lives.
    pub gpu: Gpu,
}

impl GpuModel {
    pub(crate) fn new(gpu: Gpu, config: GpuConfig, w: Weights, slots: usize, max_ctx: usize) -> Result<Self> {
        let c = &config;
        if c.head_dim > 256
            || !c.head_dim.is_multiple_of(8)
            || !c.hidden.is_multiple_of(8)
            || !c.intermediate.is_multiple_of(8)
        {
            bail!(
                "the CUDA path needs head_dim ≤ 256 and head_dim, hidden and intermediate sizes that are multiples of 8 (got {}, {}, {})",
                c.head_dim,
                c.hidden,
                c.intermediate
            );
        }
        if c.kv_heads == 0 || !c.heads.is_multiple_of(c.kv_heads) {
            bail!("heads ({}) must be a multiple of kv_heads ({})", c.heads, c.kv_heads);
        }
        if let Some(m) = &c.moe {
            if m.top_k == 0 || m.top_k > 8 || m.experts > 1024 || !m.expert_inter.is_multiple_of(8) {
                bail!(
                    "the CUDA MoE path needs 1 to 8 experts per token, at most 1024 experts and an expert width that is a multiple of 8 (got {}, {}, {})",
                    m.top_k,
                    m.experts,
                    m.expert_inter
                );
            }
            if m.shared_inter
                .is_some_and(|s| s > c.intermediate || !s.is_multiple_of(8))
            {
                bail!("the shared expert's width must be a multiple of 8 and at most intermediate_size");
            }
        }
        let inv_freq = DevBuf::new(c.inv_freq.len() * 4)?;
        gpu.upload(inv_freq.at(0), &c.inv_freq)?;
        let r = MAX_ROWS;
        let qkv_w = (c.heads + 2 * c.kv_heads) * c.head_dim;
        let s = Scratch {
            x: DevBuf::new(r * c.hidden * 4)?,
            xn: DevBuf::new(r * c.hidden * 2)?,
            qkv: DevBuf::new(r * qkv_w * 4)?,
            q: DevBuf::new(r * c.heads * c.head_dim * 4)?,
            ao: DevBuf::new(r * c.heads * c.head_dim * 2)?,
            gu: DevBuf::new(r * 2 * c.intermediate * 4)?,
            act: DevBuf::new(r * c.intermediate * 2)?,
            logits: DevBuf::new(r * c.vocab * 4)?,
            scores: DevBuf::new(1)?,
            argmax: DevBuf::new(r * 4)?,
            att_part: DevBuf::new(r * c.heads * ATT_SPLITS * (c.head_dim + 2) * 4)?,
            att_count: DevBuf::new(r * c.heads * 4)?,
            io: DevBuf::new(3 * r * 4)?,
            moe: match &c.moe {
                None => None,
                Some(m) => {
                    let ls = m.experts + usize::from(m.shared_inter.is_some());
                    let pairs = r * m.top_k;
                    Some(MoeScratch {
                        router: DevBuf::new(r * ls * 4)?,
                        ids: DevBuf::new(pairs * 4)?,
                        wts: DevBuf::new(pairs * 4)?,
                        off: DevBuf::new((m.experts + 1) * 4)?,
                        pairs: DevBuf::new(pairs * 4)?,
                        act: DevBuf::new(pairs * m.expert_inter * 2)?,
                        y: DevBuf::new(pairs * c.hidden * 4)?,
                        shared: DevBuf::new(r * c.hidden * 4)?,
                    })
                }
            },
        };
        gpu.upload(s.att_count.at(0), &vec![0i32; r * c.heads])?;
        let kv = Kv {
            k: DevBuf::new(1)?,
            v: DevBuf::new(1)?,
            slots: 0,
            max_ctx: 0,
        };
        let mut m = Self {
            gpu,
            config,
            w,
            inv_freq,
            s,
            kv,
            graphs: HashMap::new(),
            written: Vec::new(),
            use_graphs: std::env::var("SPECULA_CUDA_GRAPHS").map_or(true, |v| v != "0"),
            kernels: KernelOptions::from_env()?,
            tap_dst: Vec::new(),
            tap_buf: None,
        };
        m.resize_kv(slots, max_ctx)?;
        Ok(m)
    }

    /// Reallocate the KV cache as `slots` sequences of up to `max_ctx` positions (contents are
    /// lost; captured graphs are dropped).
    pub fn resize_kv(&mut self, slots: usize, max_ctx: usize) -> Result<()> {
        let c = &self.config;
        self.graphs.clear();
        self.kv.k = DevBuf::new(1)?;
        self.kv.v = DevBuf::new(1)?;
        self.s.scores = DevBuf::new(1)?;
        let bytes = c.layers * slots * max_ctx * c.kv_heads * c.head_dim * 2;
        self.kv.k = DevBuf::new(bytes)?;
        self.kv.v = DevBuf::new(bytes)?;
        self.s.scores = DevBuf::new(MAX_ROWS * c.heads * max_ctx * 4)?;
        self.kv.slots = slots;
        self.kv.max_ctx = max_ctx;
        self.written = vec![0; slots];
        Ok(())
    }

    pub fn slots(&self) -> usize {
        self.kv.slots
    }

    /// Size the KV cache for up to `want_slots` sequences of `want_ctx` positions within
    /// `fraction` of the device memory free now (the current KV cache counted as free): as many
    /// slots as fit, and when not even one fits, the context halved until it does (not below
    /// 256 positions). Returns (slots, positions per slot). Errors: not even one slot of 256
    /// positions fits, or the allocation fails.
    pub fn fit_kv(&mut self, want_slots: usize, want_ctx: usize, fraction: f64) -> Result<(usize, usize)> {
        let c = &self.config;
        let free = self.gpu.free_memory()? + self.kv_bytes() + self.s.scores.bytes();
        let budget = (free as f64 * fraction) as usize;
        let per_pos = c.layers * c.kv_heads * c.head_dim * 2 * 2;
        let mut ctx = want_ctx.max(1);
        loop {
            let scores = MAX_ROWS * c.heads * ctx * 4;
            let slots = budget.saturating_sub(scores) / (per_pos * ctx).max(1);
            if slots >= 1 {
                let slots = slots.min(want_slots.max(1));
                self.resize_kv(slots, ctx)?;
                return Ok((slots, ctx));
            }
            if ctx <= 256 {
                bail!(
                    "not even one KV slot of {ctx} positions fits in the {} MiB of GPU memory left after the weights",
                    free >> 20
                );
            }
            ctx = (ctx / 2).max(256);
        }
    }

    pub fn max_ctx(&self) -> usize {
        self.kv.max_ctx
    }

    /// Bytes of weights a decode step reads.
    pub fn weight_bytes(&self) -> usize {
        self.w.bytes()
    }

    /// Bytes of the weights a one-row step reads: [`GpuModel::weight_bytes`] with only the
    /// experts a token is routed to counted on an MoE model.
    pub fn step_bytes(&self) -> usize {
        match &self.config.moe {
            Some(m) => self.w.step_bytes(m.top_k),
            None => self.w.bytes(),
        }
    }

    /// Bytes of the KV cache.
    pub fn kv_bytes(&self) -> usize {
        self.kv.k.bytes() * 2
    }

    pub(crate) fn check_rows(&self, rows: &[Row]) -> Result<()> {
        if rows.is_empty() || rows.len() > MAX_ROWS {
            bail!("a forward takes 1..={MAX_ROWS} rows, got {}", rows.len());
        }
        for r in rows {
            if r.token as usize >= self.config.vocab {
                bail!("token id {} is outside the vocabulary ({})", r.token, self.config.vocab);
            }
            if r.slot as usize >= self.kv.slots {
                bail!("KV slot {} out of range ({} slots)", r.slot, self.kv.slots);
            }
            if r.pos as usize >= self.kv.max_ctx {
                bail!(
                    "position {} is past the KV cache ({} positions)",
                    r.pos,
                    self.kv.max_ctx
                );
            }
        }
        Ok(())
    }

    pub(crate) fn write_io(&self, rows: &[Row]) -> Result<()> {
        let mut io = vec![0i32; 3 * MAX_ROWS];
        for (i, r) in rows.iter().enumerate() {
            io[i] = r.token as i32;
            io[MAX_ROWS + i] = r.pos as i32;
            io[2 * MAX_ROWS + i] = r.slot as i32;
        }
        self.gpu.upload(self.s.io.at(0), &io)
    }

    /// Enqueue the forward of `n` rows whose inputs are in the io buffer. `distinct`: no two
    /// rows share a KV slot, so no row reads a position another row of this forward writes,
    /// and the attention kernels may write each row's k and v themselves
    /// (`attention_rope_rows_*`).
    pub(crate) fn enqueue(&self, n: usize, logits: LogitsRows, distinct: bool) -> Result<()> {
        let g = &self.gpu;
        let c = &self.config;
        let s = &self.s;
        let (h, hd, nh, nkv, inter) = (c.hidden, c.head_dim, c.heads, c.kv_heads, c.intermediate);
        let qkv_w = (nh + 2 * nkv) * hd;
        let tok = s.io.at(0);
        let pos = s.io.at(MAX_ROWS * 4);
        let slot = s.io.at(2 * MAX_ROWS * 4);
        let nu = n as u32;
        // Blocks per row and head for the attention: enough for a few waves on the SMs when
        // the rows are few (a long context's key ranges then run side by side). Changes speed,
        // never bits: a row's key ranges depend on its position only.
        let fu = &self.kernels;
        let att_deep = fu.att_deep.unwrap_or(n <= ATT_DEEP_ROWS);
        // Query heads per attention block: a group of 4 shares each K/V row it loads (the
        // `attention_rows_g4` kernel; the same bits per head).
        let qpk = nh / nkv;
        let group = !att_deep && hd <= 128 && fu.att_group >= 4 && qpk.is_multiple_of(4);
        let qg = if group && n * nkv * (qpk / 4) >= ATT_GROUP_MIN_BLOCKS {
            4
        } else {
            1
        };
        let att_heads = if qg == 1 { nh } else { nkv * (qpk / qg) };
        let att_blocks = (528 / (n * att_heads).max(1)).clamp(1, ATT_SPLITS) as u32;
        g.launch(
            "embed_rows",
            (nu, 1),
            256,
            &[A::P(self.w.embed.at(0)), A::P(tok), A::P(s.x.at(0)), A::I(h as i32)],
        )?;
        let layer_kv = self.kv.slots * self.kv.max_ctx * nkv * hd * 2;
        // Forwards of rows of different sequences (batch-1 decode; up to ATT_DEEP_ROWS rows, or
        // the grouped widths with SPECULA_CUDA_FUSE_ROPE=wide) do the RoPE / KV write in the
        // attention kernel: the same device code, so the same bits as the separate kernel the
        // other forwards run (which the verify-row checks compare).
        let rope_fits = fu.rope && distinct && 2 * hd.next_multiple_of(32) <= 256;
        let rope_g4 = fu.att_g4_rope.filter(|_| fu.rope_wide);
        let fuse_rope = rope_fits && (att_deep || (qg == 4 && rope_g4.is_some()));
        for (li, l) in self.w.layers.iter().enumerate() {
            if !fu.skips("norm") {
                g.rmsnorm(s.x.at(0), l.attn_norm.at(0), s.xn.at(0), n, h, c.rms_eps)?;
            }
            g.gemm(l.qkv.ptrs(), s.xn.at(0), None, s.qkv.at(0), n, qkv_w, h)?;
            let opt = |b: &Option<DevBuf>| b.as_ref().map(|b| b.at(0)).unwrap_or(0);
            let rope_args = [
                A::P(s.qkv.at(0)),
                A::P(opt(&l.qkv_bias)),
                A::P(opt(&l.q_norm)),
                A::P(opt(&l.k_norm)),
                A::P(self.inv_freq.at(0)),
            ];
            let (kc, vc) = (self.kv.k.at(li * layer_kv), self.kv.v.at(li * layer_kv));
            let (nh_a, nkv_a, hd_a, ctx_a) = (
                A::I(nh as i32),
                A::I(nkv as i32),
                A::I(hd as i32),
                A::I(self.kv.max_ctx as i32),
            );
            if !fu.skips("rope") && !fuse_rope {
                let mut args = rope_args.to_vec();
                args.extend([A::P(pos), A::P(slot), A::P(s.q.at(0)), A::P(kc), A::P(vc)]);
                args.extend([nh_a, nkv_a, hd_a, ctx_a, A::F(c.rms_eps)]);
                args.push(A::I(c.interleaved_rope as i32));
                g.launch(
                    "qkv_rope_store",
                    (nu, (nh + 2 * nkv) as u32),
                    hd.next_multiple_of(32) as u32,
                    &args,
                )?;
            }
            if !fu.skips("attn") {
                let mut args = vec![A::P(s.q.at(0)), A::P(kc), A::P(vc), A::P(pos), A::P(slot)];
                args.extend([A::P(s.scores.at(0)), A::P(s.att_part.at(0)), A::P(s.att_count.at(0))]);
                args.extend([A::P(s.ao.at(0)), nh_a, nkv_a, hd_a, ctx_a]);
                args.extend([A::F(1.0 / (hd as f32).sqrt()), A::I(att_blocks as i32)]);
                // `_h128`: the same kernel with half the registers for K chunks.
                let h128 = hd <= 128;
                let name = if fuse_rope {
                    args.extend(rope_args);
                    args.extend([A::F(c.rms_eps), A::I(c.interleaved_rope as i32)]);
                    if let (4, Some(k)) = (qg, rope_g4) {
                        k
                    } else if h128 {
                        "attention_rope_rows_deep_h128"
                    } else {
                        "attention_rope_rows_deep"
                    }
                } else if att_deep {
                    if h128 {
                        "attention_rows_deep_h128"
                    } else {
                        "attention_rows_deep"
                    }
                } else if qg == 4 {
                    fu.att_g4
                } else if h128 {
                    "attention_rows_h128"
                } else {
                    "attention_rows"
                };
                if fu.att_range_last {
                    g.launch3(name, (nu, att_heads as u32, att_blocks), 256, 0, &args)?;
                } else {
                    g.launch(name, (nu * att_blocks, att_heads as u32), 256, &args)?;
                }
            }
            let (x, xn) = (s.x.at(0), s.xn.at(0));
            g.gemm(l.o.ptrs(), s.ao.at(0), Some(x), x, n, h, nh * hd)?;
            if !fu.skips("norm") {
                g.rmsnorm(x, l.mlp_norm.at(0), xn, n, h, c.rms_eps)?;
            }
            match &l.mlp {
                LayerMlp::Dense { gate_up, down } => {
                    self.dense_mlp(gate_up, down, inter, n, Some(x), x)?;
                }
                LayerMlp::Moe(m) => self.moe_mlp(m, n)?,
            }
            for &(_, dst) in self.tap_dst.iter().filter(|(tl, _)| *tl == li) {
                g.copy(dst, x, n * h * 4)?;
            }
        }
        let (first, m) = match logits {
            LogitsRows::None => return Ok(()),
            LogitsRows::Last => (n - 1, 1),
            LogitsRows::All => (0, n),
        };
        g.rmsnorm(
            s.x.at(first * h * 4),
            self.w.final_norm.at(0),
            s.xn.at(0),
            m,
            h,
            c.rms_eps,
        )?;
        let head = self.w.lm_head.as_ref().map_or((self.w.embed.at(0), 0), |h| h.ptrs());
        g.gemm(head, s.xn.at(0), None, s.logits.at(0), m, c.vocab, h)?;
        g.launch(
            "argmax_rows",
            (m as u32, 1),
            1024,
            &[A::P(s.logits.at(0)), A::I(c.vocab as i32), A::P(s.argmax.at(0))],
        )
    }

    /// The dense gated MLP of the normed rows `s.xn` (`n` rows): `y = down(silu(gate) · up)`
    /// (`+ r`), `width` its intermediate size.
    fn dense_mlp(&self, gate_up: &Mat, down: &Mat, width: usize, n: usize, r: Option<u64>, y: u64) -> Result<()> {
        let (g, s, h) = (&self.gpu, &self.s, self.config.hidden);
        let xn = s.xn.at(0);
        if g.gemm_path() == GemmPath::Mma && self.kernels.silu {
            let act = Epilogue::SiluMul { act: s.act.at(0) };
            g.gemm_epi(gate_up.ptrs(), xn, None, s.gu.at(0), n, 2 * width, h, act)?;
        } else {
            g.gemm(gate_up.ptrs(), xn, None, s.gu.at(0), n, 2 * width, h)?;
            if !self.kernels.skips("silu") {
                let total = n * width;
                g.launch(
                    "silu_mul",
                    ((total.div_ceil(256)).min(65536) as u32, 1),
                    256,
                    &[A::P(s.gu.at(0)), A::P(s.act.at(0)), A::I(width as i32), A::I(n as i32)],
                )?;
            }
        }
        g.gemm(down.ptrs(), s.act.at(0), r, y, n, h, width)
    }

    /// The MoE MLP of the normed rows `s.xn`, added to the residual `s.x`: the router's
    /// logits (a batch-invariant GEMM), each row's top-k (`moe_route`), the pairs of each
    /// expert (`moe_plan`), every pair's gate/up and down products (`moe_gate_up`,
    /// `moe_down`: one block per expert and feature tile), the shared expert as a dense MLP,
    /// and the weighted sum in rank order (`moe_combine`).
    fn moe_mlp(&self, m: &MoeLayer, n: usize) -> Result<()> {
        let (g, s, c) = (&self.gpu, &self.s, &self.config);
        let (Some(cfg), Some(ms)) = (&c.moe, &s.moe) else {
            bail!("an MoE layer in a model without MoE buffers");
        };
        let h = c.hidden;
        let e = cfg.experts;
        let ls = e + usize::from(m.shared.is_some());
        let k = cfg.top_k;
        let xn = s.xn.at(0);
        g.gemm(m.router.ptrs(), xn, None, ms.router.at(0), n, ls, h)?;
        g.launch(
            "moe_route",
            (n as u32, 1),
            32,
            &[
                A::P(ms.router.at(0)),
                A::I(e as i32),
                A::I(ls as i32),
                A::I(k as i32),
                A::I(cfg.norm_topk as i32),
                A::P(ms.ids.at(0)),
                A::P(ms.wts.at(0)),
            ],
        )?;
        let plan_threads = e.next_multiple_of(32) as u32;
        g.launch_smem(
            "moe_plan",
            (1, 1),
            plan_threads,
            ((e + 1) * 4) as u32,
            &[
                A::P(ms.ids.at(0)),
                A::I((n * k) as i32),
                A::I(e as i32),
                A::P(ms.off.at(0)),
                A::P(ms.pairs.at(0)),
            ],
        )?;
        // Each pair's products of its expert: `out` = `mat` · `x` rows, `f` outputs of width
        // `kd`, 8 warps of 2 features a block (the `_q8` kernel for Q8_0 experts).
        let gemv = |name: &str, mat: &Mat, x: u64, out: u64, f: usize, kd: usize| {
            let (w, d) = mat.ptrs();
            let q8 = if mat.scales.is_some() { "_q8" } else { "" };
            g.launch(
                &format!("{name}{q8}"),
                (f.div_ceil(16) as u32, e as u32),
                256,
                &[
                    A::P(w),
                    A::P(d),
                    A::P(x),
                    A::P(ms.off.at(0)),
                    A::P(ms.pairs.at(0)),
                    A::I(k as i32),
                    A::P(out),
                    A::I(f as i32),
                    A::I(kd as i32),
                ],
            )
        };
        let ei = cfg.expert_inter;
        gemv("moe_gate_up", &m.gate_up, xn, ms.act.at(0), ei, h)?;
        gemv("moe_down", &m.down, ms.act.at(0), ms.y.at(0), h, ei)?;
        let shared = match (&m.shared, cfg.shared_inter) {
            (Some((gate_up, down)), Some(si)) => {
                self.dense_mlp(gate_up, down, si, n, None, ms.shared.at(0))?;
                ms.shared.at(0)
            }
            _ => 0,
        };
        let total = n * h;
        g.launch(
            "moe_combine",
            ((total.div_ceil(256)).min(65536) as u32, 1),
            256,
            &[
                A::P(s.x.at(0)),
                A::P(ms.y.at(0)),
                A::P(ms.wts.at(0)),
                A::I(k as i32),
                A::I(h as i32),
                A::I(n as i32),
                A::P(shared),
                A::P(ms.router.at(0)),
                A::I(ls as i32),
                A::I(e as i32),
            ],
        )
    }

    pub(crate) fn capture(&self, n: usize, distinct: bool) -> Result<Graph> {
        let st = self.gpu.stream;
        self.gpu.synchronize()?;
        trace_always(&format!("capturing a graph for {n} rows"));
        ck(
            unsafe { sys::cuStreamBeginCapture_v2(st, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED) },
            "cuStreamBeginCapture",
        )?;
        self.gpu.capturing.set(true);
        let enq = self.enqueue(n, LogitsRows::All, distinct);
        let mut graph = std::ptr::null_mut();
        let end = ck(unsafe { sys::cuStreamEndCapture(st, &mut graph) }, "cuStreamEndCapture");
        self.gpu.capturing.set(false);
        if enq.is_err() && !graph.is_null() {
            unsafe {
                sys::cuGraphDestroy(graph);
            }
        }
        enq?;
        end?;
        trace_always("instantiating");
        let mut exec = std::ptr::null_mut();
        if let Err(e) = ck(
            unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) },
            "cuGraphInstantiate",
        ) {
            unsafe {
                sys::cuGraphDestroy(graph);
            }
            return Err(e);
        }
        trace_always("captured");
        Ok(Graph { graph, exec })
    }

    /// One forward over `rows` (any mix of sequences and positions); every row gets logits.
    /// Each row's keys and values are written at (slot, pos) first, so a row attends to its own
    /// slot's positions `0..=pos`, the rows before it in this call included.
    ///
    /// Returns per row the greedy token, and the logits `[rows, vocab]` f32 when `want_logits`.
    /// Errors: no rows or more than [`MAX_ROWS`], a token outside the vocabulary, a slot or
    /// position outside the KV cache, or a CUDA failure.
    pub fn forward(&mut self, rows: &[Row], want_logits: bool) -> Result<StepOut> {
        self.check_rows(rows)?;
        let n = rows.len();
        self.write_io(rows)?;
        let distinct = distinct_slots(rows);
        if self.use_graphs && n <= GRAPH_MAX_ROWS {
            self.launch_graph(n, distinct)?;
        } else {
            self.enqueue(n, LogitsRows::All, distinct)?;
        }
        self.read_out(n, want_logits)
    }

    /// Replay the captured graph of an `n`-row forward (all logits rows), capturing it first
    /// if this width has none yet.
    pub(crate) fn launch_graph(&mut self, n: usize, distinct: bool) -> Result<()> {
        let key = (n, distinct);
        if !self.graphs.contains_key(&key) {
            let g = self.capture(n, distinct)?;
            self.graphs.insert(key, g);
        }
        let exec = self.graphs[&key].exec;
        trace_always("cuGraphLaunch");
        ck(unsafe { sys::cuGraphLaunch(exec, self.gpu.stream) }, "cuGraphLaunch")?;
        trace_always("launched");
        Ok(())
    }

    /// As [`GpuModel::forward`], returning per row what `need` asks (in row order, nothing for
    /// [`RowNeed::None`]) and downloading only that: the argmax the device computed, or the f32
    /// logits `[vocab]`. A wide forward (past the graph widths) that needs no row, or only its
    /// last, runs the LM head on that row alone. Errors: as [`GpuModel::forward`], or `need` of
    /// another length than `rows`.
    pub fn forward_select(&mut self, rows: &[Row], need: &[RowNeed]) -> Result<Vec<RowOut>> {
        self.check_rows(rows)?;
        if need.len() != rows.len() {
            bail!("{} row needs for {} rows", need.len(), rows.len());
        }
        let n = rows.len();
        self.write_io(rows)?;
        let wanted = need.iter().filter(|&&w| w != RowNeed::None).count();
        let only_last = wanted == 0 || (wanted == 1 && need[n - 1] != RowNeed::None);
        let distinct = distinct_slots(rows);
        // Logits row r of the buffer holds input row `first + r`.
        let first = if self.use_graphs && n <= GRAPH_MAX_ROWS {
            self.launch_graph(n, distinct)?;
            0
        } else if only_last {
            let mode = if wanted == 0 {
                LogitsRows::None
            } else {
                LogitsRows::Last
            };
            self.enqueue(n, mode, distinct)?;
            n - 1
        } else {
            self.enqueue(n, LogitsRows::All, distinct)?;
            0
        };
        let v = self.config.vocab;
        let mut am = Vec::new();
        if need.contains(&RowNeed::Argmax) {
            am = vec![0i32; n - first];
            self.gpu.download(&mut am, self.s.argmax.at(0))?;
        }
        let mut out = Vec::with_capacity(wanted);
        let mut i = 0;
        while i < n {
            match need[i] {
                RowNeed::None => i += 1,
                RowNeed::Argmax => {
                    // A row without a finite maximum gives 0, as the host's argmax does.
                    let t = am[i - first];
                    out.push(RowOut::Argmax(if (0..v as i32).contains(&t) { t as u32 } else { 0 }));
                    i += 1;
                }
                RowNeed::Logits => {
                    // One download per run of logits rows.
                    let mut j = i;
                    while j < n && need[j] == RowNeed::Logits {
                        j += 1;
                    }
                    let mut buf = vec![0f32; (j - i) * v];
                    self.gpu.download(&mut buf, self.s.logits.at((i - first) * v * 4))?;
                    out.extend(buf.chunks_exact(v).map(|r| RowOut::Logits(r.to_vec())));
                    i = j;
                }
            }
        }
        if wanted == 0 {
            self.gpu.synchronize()?;
        }
        Ok(out)
    }

    /// Run one forward over `rows` kernel by kernel with CUDA events around each launch, and
    /// return the time per kernel (the KV cache is written as by [`GpuModel::forward`]).
    pub fn profile(&mut self, rows: &[Row]) -> Result<Profile> {
        self.check_rows(rows)?;
        self.write_io(rows)?;
        self.gpu.synchronize()?;
        self.gpu.start_profile();
        let r = self.enqueue(rows.len(), LogitsRows::All, distinct_slots(rows));
        let p = self.gpu.finish_profile();
        r?;
        p
    }

    /// Switch the projection kernels (captured graphs are dropped).
    pub fn set_gemm_path(&mut self, path: GemmPath) {
        self.graphs.clear();
        self.gpu.gemm_path.set(path);
    }

    pub(crate) fn read_out(&self, m: usize, want_logits: bool) -> Result<StepOut> {
        let mut am = vec![0i32; m];
        self.gpu.download(&mut am, self.s.argmax.at(0))?;
        let mut out = StepOut {
            argmax: am.into_iter().map(|t| t as u32).collect(),
            logits: Vec::new(),
        };
        if want_logits {
            out.logits = vec![0f32; m * self.config.vocab];
            self.gpu.download(&mut out.logits, self.s.logits.at(0))?;
        }
        Ok(out)
    }

    /// Prefill `tokens` into `slot` at positions `start..`, in chunks of [`MAX_ROWS`] rows;
    /// returns the greedy token (and logits when asked) of the last row only.
    pub fn prefill(&mut self, slot: u32, start: u32, tokens: &[u32], want_logits: bool) -> Result<StepOut> {
        if tokens.is_empty() {
            bail!("prefill needs at least one token");
        }
        let mut out = StepOut::default();
        let chunks = tokens.len().div_ceil(MAX_ROWS);
        for (ci, chunk) in tokens.chunks(MAX_ROWS).enumerate() {
            let base = start + (ci * MAX_ROWS) as u32;
            let rows: Vec<Row> = chunk
                .iter()
                .enumerate()
                .map(|(i, &token)| Row {
                    token,
                    slot,
                    pos: base + i as u32,
                })
                .collect();
            self.check_rows(&rows)?;
            self.write_io(&rows)?;
            let last = ci + 1 == chunks;
            let logits = if last { LogitsRows::Last } else { LogitsRows::None };
            self.enqueue(rows.len(), logits, rows.len() == 1)?;
            if last {
                out = self.read_out(1, want_logits)?;
            }
        }
        Ok(out)
    }
}

/// Whether no two rows share a KV slot (then no row reads a position another writes).
pub(crate) fn distinct_slots(rows: &[Row]) -> bool {
    let mut s: Vec<u32> = rows.iter().map(|r| r.slot).collect();
    s.sort_unstable();
    s.windows(2).all(|w| w[0] != w[1])
}

impl Drop for GpuModel {
    fn drop(&mut self) {
        // The fields' destructors free device memory, graphs and the module: make the context
        // current on this thread first (it may not be the thread that built the model).
        let _ = self.gpu.bind();
    }
}

// SAFETY: the raw handles a `GpuModel` holds (stream, module, functions, graphs, device
// memory) belong to its CUDA context, not to a thread; the driver accepts them from any thread
// on which that context is current. A `GpuModel` moved to another thread is used there only
// through `&mut self` (the engine keeps it behind a mutex) and `DeviceTarget::forward` makes
// the context current first. The `Cell`s inside `Gpu` are never shared across threads.
unsafe impl Send for GpuModel {}

impl crate::device::DeviceTarget for GpuModel {
    fn device_name(&self) -> String {
        self.gpu.name()
    }

    fn slots(&self) -> usize {
        self.kv.slots
    }

    fn max_ctx(&self) -> usize {
        self.kv.max_ctx
    }

    fn max_rows(&self) -> usize {
        MAX_ROWS
    }

    fn vocab(&self) -> usize {
        self.config.vocab
    }

    fn batch_invariant(&self) -> bool {
        // Every kernel reduces in an order fixed by the shapes alone (docs/gpu.md).
        true
    }

    fn forward(&mut self, rows: &[crate::device::DeviceRow], want: &[RowNeed]) -> Result<Vec<RowOut>> {
        self.gpu.bind()?;
        let (rows, written) = self.device_rows(rows)?;
        let out = self.forward_select(&rows, want)?;
        self.written = written;
        Ok(out)
    }

    fn forward_hidden(&mut self, rows: &[crate::device::DeviceRow], taps: &[usize]) -> Result<(Vec<f32>, Vec<f32>)> {
        let (h, layers) = (self.config.hidden, self.config.layers);
        if let Some(&bad) = taps.iter().find(|&&t| t >= layers) {
            bail!(
                "{}: hidden states of blocks 0..{layers} only, not tap {bad}",
                self.gpu.name()
            );
        }
        self.gpu.bind()?;
        let (rows, written) = self.device_rows(rows)?;
        self.check_rows(&rows)?;
        let n = rows.len();
        self.write_io(&rows)?;
        let distinct = distinct_slots(&rows);
        let last_only = taps == [layers - 1];
        if last_only && self.use_graphs && n <= GRAPH_MAX_ROWS {
            self.launch_graph(n, distinct)?;
        } else if last_only {
            self.enqueue(n, LogitsRows::All, distinct)?;
        } else {
            // Other blocks' outputs are copied out of the residual stream as the forward
            // passes them (outside captured graphs).
            let stride = MAX_ROWS * h * 4;
            if self.tap_buf.as_ref().is_none_or(|b| b.bytes < taps.len() * stride) {
                // Free the smaller buffer before allocating the larger one.
                self.tap_buf = None;
                self.tap_buf = Some(DevBuf::new(taps.len() * stride)?);
            }
            let base = self.tap_buf.as_ref().map_or(0, |b| b.at(0));
            self.tap_dst = taps
                .iter()
                .enumerate()
                .map(|(i, &t)| (t, base + (i * stride) as u64))
                .collect();
            let r = self.enqueue(n, LogitsRows::All, distinct);
            self.tap_dst.clear();
            r?;
        }
        let mut logits = vec![0f32; n * self.config.vocab];
        self.gpu.download(&mut logits, self.s.logits.at(0))?;
        let hidden = if last_only {
            // The residual stream `x` holds the last block's output: the final norm writes `xn`.
            let mut hidden = vec![0f32; n * h];
            self.gpu.download(&mut hidden, self.s.x.at(0))?;
            hidden
        } else {
            let mut per_tap = Vec::with_capacity(taps.len());
            for i in 0..taps.len() {
                let mut v = vec![0f32; n * h];
                let at = self.tap_buf.as_ref().map_or(0, |b| b.at(i * MAX_ROWS * h * 4));
                self.gpu.download(&mut v, at)?;
                per_tap.push(v);
            }
            crate::device::interleave_taps(&per_tap, n, h)
        };
        self.written = written;
        Ok((logits, hidden))
    }
}

impl GpuModel {
    /// Device rows as the forward's rows, and what each slot holds after them. Rows of a slot
    /// come in position order, each at most one past what the slot holds (errors otherwise).
    pub(crate) fn device_rows(&self, rows: &[crate::device::DeviceRow]) -> Result<(Vec<Row>, Vec<u32>)> {
        let mut written = self.written.clone();
        for r in rows {
            let Some(w) = written.get_mut(r.slot as usize) else {
                bail!("slot {} out of range ({} slots)", r.slot, self.kv.slots);
            };
            if r.pos > *w {
                bail!("slot {}: position {} past the {} positions written", r.slot, r.pos, *w);
            }
            *w = r.pos + 1;
        }
        let rows: Vec<Row> = rows
            .iter()
            .map(|r| Row {
                token: r.token,
                slot: r.slot,
                pos: r.pos,
            })
            .collect();
        Ok((rows, written))
    }
}
