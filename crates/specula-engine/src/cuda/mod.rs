//! The CUDA backend (feature `cuda`): a dense Llama / Qwen2 / Qwen3 forward on one NVIDIA GPU,
//! built for decode and verify, and batch-invariant like the CPU kernels.
//!
//! * Projection weights are bf16 or Q8_0 in device memory (synthetic ones generated on the
//!   device, `--dtype q8_0` for Q8_0), or a bundle's tensors converted to bf16 at load (GGUF
//!   quantized types are dequantized: keeping Q8_0 tensors quantized is not built yet). Norms and
//!   the embedding are bf16.
//! * The projections run on tensor cores (`mma.sync`) for any row count, with a fold order that
//!   depends only on K, so decode, verify and batched rows get the same bits.
//! * The KV cache is preallocated, `[layers][slots][max_ctx][kv_heads][head_dim]` bf16, and
//!   written in place; a row names its slot and position, so one forward serves a verify block of
//!   one sequence, decode rows of many sequences, or a mix (continuous batching). Rolling back a
//!   rejected draft is free: the next forward overwrites those positions.
//! * Token, position and slot of each row live in device memory, so one captured CUDA graph per
//!   row count (up to [`GRAPH_MAX_ROWS`]) replays every decode / verify step of that width.
//! * Batch invariance: every kernel computes a row with the same instructions in the same order
//!   whatever the other rows are (`kernels.cu` says how), so the logits of row i of a k+1-row
//!   verify are bitwise those of a one-row decode at that position. [`bench`] checks this on the
//!   device, and checks greedy n-gram speculation against AR.
//!
//! Source: the model math is HF transformers' `modeling_llama` / `modeling_qwen2` /
//! `modeling_qwen3` (RMSNorm, rotate-half RoPE, GQA attention, SwiGLU).

pub mod bench;
pub mod load;

use crate::device::{RowNeed, RowOut};
use anyhow::{bail, Result};
use cudarc::driver::{sys, CudaContext};
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::Arc;

pub use load::{GpuConfig, SHAPES};

static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/kernels.fatbin"));

/// Row counts up to this run from a captured CUDA graph; wider forwards (prefill) launch
/// kernel by kernel.
pub const GRAPH_MAX_ROWS: usize = 64;

/// Rows one forward takes at most (prefill runs in chunks of this many).
pub const MAX_ROWS: usize = 256;

/// Key ranges a row's attention is split into at most (`ATT_SPLITS` in kernels.cu): a long
/// context is spread over that many blocks per row and head; how many run depends on the row's
/// position only.
const ATT_SPLITS: usize = 16;

/// `SPECULA_CUDA_SYNC=1`: synchronize after every kernel and log each launch (debugging).
/// Whether this build can run on a GPU here: it has kernels (not a `SPECULA_CUDA_STUB=1`
/// build) and the CUDA driver library loads. Errors say which is missing, so callers can
/// refuse `--device cuda:N` before loading a model. Does not open a device.
pub fn check_available() -> Result<()> {
    if FATBIN.is_empty() {
        bail!("this specula was built with SPECULA_CUDA_STUB=1: it has no GPU kernels (docs/gpu.md)");
    }
    // A `cuda-train` build links the driver library: it would not have started without it.
    #[cfg(feature = "cuda")]
    if !unsafe { sys::is_culib_present() } {
        bail!("no CUDA driver library (libcuda.so) found: is there an NVIDIA GPU and driver on this machine, and is its library folder on LD_LIBRARY_PATH? (docs/gpu.md)");
    }
    Ok(())
}

fn sync_each() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SPECULA_CUDA_SYNC").is_ok_and(|v| v == "1"))
}

/// A line on stderr when `SPECULA_CUDA_TRACE=1`.
fn trace_always(what: &str) {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *ON.get_or_init(|| std::env::var("SPECULA_CUDA_TRACE").is_ok_and(|v| v == "1")) {
        eprintln!("[cuda] {what}");
    }
}

/// A line on stderr when `SPECULA_CUDA_SYNC=1`.
pub(crate) fn trace(what: &str) {
    if sync_each() {
        eprintln!("[cuda] {what}");
    }
}

pub(crate) fn ck(r: sys::CUresult, what: &str) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        bail!("CUDA error in {what}: {r:?}")
    }
}

/// An owned device allocation (`cuMemAlloc`), freed on drop.
pub struct DevBuf {
    ptr: sys::CUdeviceptr,
    bytes: usize,
}

impl DevBuf {
    pub fn new(bytes: usize) -> Result<Self> {
        let mut ptr = 0;
        ck(unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(256)) }, "cuMemAlloc")
            .map_err(|e| anyhow::anyhow!("allocating {} MiB on the GPU: {e}", bytes >> 20))?;
        Ok(Self { ptr, bytes })
    }

    /// The device address `byte_offset` bytes in.
    pub fn at(&self, byte_offset: usize) -> u64 {
        self.ptr + byte_offset as u64
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        unsafe {
            sys::cuMemFree_v2(self.ptr);
        }
    }
}

/// A kernel argument.
#[derive(Clone, Copy)]
pub(crate) enum A {
    /// A device pointer (0 for null).
    P(u64),
    I(i32),
    F(f32),
    U64(u64),
}

/// The GPU: context, one stream, the loaded kernels.
pub struct Gpu {
    /// Set while a graph is being captured (no stream synchronization is allowed then).
    capturing: std::cell::Cell<bool>,
    ctx: Arc<CudaContext>,
    stream: sys::CUstream,
    module: sys::CUmodule,
    f: HashMap<&'static str, sys::CUfunction>,
    /// The projection kernels (`SPECULA_CUDA_GEMM=gemv` picks the reference FMA kernels).
    gemm_path: std::cell::Cell<GemmPath>,
    /// The GEMM kernel above 32 rows ([`Wide`], `SPECULA_CUDA_GEMM_WIDE=2|4|seq|seq32`, default
    /// 2: on the H200 (qwen3-8b bf16) the 2x8 tile with its operands through the
    /// ring beat every seq kernel at 64 rows and in prefill, 512 tokens 9,261 tok/s against
    /// 8,041 with `gemm_seq`).
    wide: std::cell::Cell<Wide>,
    /// How the 64-row `gemm_seq` tile holds its weights in flight ([`SeqWeights`],
    /// `SPECULA_CUDA_SEQ_W=4|6|ring`; speed only).
    seq_w: std::cell::Cell<SeqWeights>,
    /// [`Wide::Seq`]: the K split across blocks is the smallest of 1, 2, 4, 8 that gives at
    /// least this many blocks (`SPECULA_CUDA_SEQ_BLOCKS`, 1..=[`SEQ_MAX_TILES`]; speed only).
    seq_blocks: std::cell::Cell<usize>,
    /// f32 `[SEQ_MAX_TILES, 8 slices, 128 features x 64 rows]`: the slice partials of a
    /// `gemm_seq` launch split over blocks; and i32 `[SEQ_MAX_TILES]` blocks finished per tile
    /// (zero between launches).
    seq_part: DevBuf,
    seq_count: DevBuf,
    /// How the 2x8 tile streams its operands: 0 the weights through registers, 1 + i the ring
    /// kind i of [`GEMM_PIPE`], [`PIPE_AUTO`] (bf16) `_pp` for layers whose `_pp` grid has at
    /// least a block a multiprocessor, else `_px2` for launches of more blocks than
    /// multiprocessors, else `_px`; Q8_0 `_px` (`SPECULA_CUDA_GEMM_PIPE=0|w|px|px4|px2|pp|auto`,
    /// default auto; speed only).
    pipe: std::cell::Cell<u8>,
    /// Multiprocessors of the device.
    sms: usize,
    /// At 33..64 rows, layers whose 2x8 grid has at most one block a multiprocessor run the
    /// 2x4 tile with its operands through the ring ([`GEMM_PX24`]), twice the blocks
    /// (`SPECULA_CUDA_NARROW64=1`; speed only). Off by default: on the H200 (qwen3-8b bf16, 64
    /// rows) the down GEMM took 2.12 ms a step with it against 1.81 without (o 0.86
    /// against 0.88), 64 streams 7,191 against 7,642 tok/s.
    narrow64: std::cell::Cell<bool>,
    /// Narrow tiles of at least this many n-tiles (1: 1x1 and 1x2, 2: 1x2 only, 3: none) run
    /// with two alternating register batches ([`GEMM_DB`]; the same bits). On the H200
    /// (qwen3-8b, one call) the 1x1 tile ran 187 against 216 tok/s that way, the 1x2 tile 5-6%
    /// faster (10 and 16 rows), so the default is 2; `SPECULA_CUDA_GEMM1=db|plain` sets 1 or 3.
    db_from_nt: std::cell::Cell<usize>,
    /// While profiling, the label of the next launch's entry (a GEMM's shape); empty: its name.
    profile_tag: std::cell::RefCell<String>,
    /// Launch with programmatic dependent launch (`SPECULA_CUDA_PDL=0` turns it off): a
    /// kernel's prologue (the GEMM's first weight loads) overlaps the previous kernel's tail.
    pdl: bool,
    /// While set, every launch is bracketed by CUDA events (see [`Gpu::start_profile`]).
    profile: std::cell::RefCell<Option<Vec<LaunchEvents>>>,
}

/// Every kernel `Gpu::open` loads, besides the GEMMs of [`GEMM_NAMES`].
const KERNELS: [&str; 36] = [
    "gemv_m1",
    "gemv_m2",
    "gemv_m3",
    "gemv_m4",
    "gemv_m5",
    "gemv_m6",
    "gemv_m7",
    "gemv_m8",
    "gemv_m9",
    "gemv_m10",
    "gemv_m11",
    "gemv_m12",
    "gemv_m13",
    "gemv_m14",
    "gemv_m15",
    "gemv_m16",
    "embed_rows",
    "rmsnorm_bf16",
    "qkv_rope_store",
    "attention_rows",
    "attention_rows_h128",
    "attention_rows_deep",
    "attention_rows_deep_h128",
    "attention_rows_g4",
    "attention_rows_g4_b3",
    "attention_rows_g4_b4",
    "attention_rows_g4_b4_pf",
    "attention_rows_g4_b4_k4",
    "attention_rope_rows_deep",
    "attention_rope_rows_deep_h128",
    "attention_rope_rows_g4_b4",
    "attention_rope_rows_g4_b4_k4",
    "silu_mul",
    "argmax_rows",
    "fill_uniform_bf16",
    "fill_q8",
];

/// Which kernels run the projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum GemmPath {
    /// `gemm_{bf16,q8}_{MT}x{NT}`: tensor cores (mma.sync), any row count, bf16 and Q8_0.
    Mma,
    /// `gemv_m{M}`: CUDA-core FMAs, bf16 only, chunks of 16 rows (the first kernels; kept as a
    /// reference and for side-by-side timing).
    Gemv,
}

/// A weight matrix `[n, k]` on the device: bf16 values, or Q8_0 as int8 values `[n, k]` plus
/// one f32 scale per 32-wide chunk of a row, `[n, ceil(k / 32)]` (llama.cpp's Q8_0 block,
/// repacked so both parts load as aligned vectors).
pub(crate) struct Mat {
    pub data: DevBuf,
    pub scales: Option<DevBuf>,
}

impl Mat {
    pub fn bf16(data: DevBuf) -> Self {
        Self { data, scales: None }
    }

    pub fn bytes(&self) -> usize {
        self.data.bytes() + self.scales.as_ref().map_or(0, |s| s.bytes())
    }

    /// (values, scales or 0) device addresses for [`Gpu::gemm`].
    pub fn ptrs(&self) -> (u64, u64) {
        (self.data.at(0), self.scales.as_ref().map_or(0, |s| s.at(0)))
    }
}

/// One profiled launch: the kernel and the events recorded before and after it.
type LaunchEvents = (String, sys::CUevent, sys::CUevent);

/// Kernel timings of one forward (`SPECULA`'s own breakdown, from CUDA events around each
/// launch): per kernel name, launches and total milliseconds.
pub type Profile = Vec<(String, usize, f64)>;

impl Gpu {
    /// Open device `ordinal` (the N of `cuda:N`) and load the kernels. Errors: no driver, no
    /// such device, or kernels the driver cannot load (they are built for sm_90 with compute_90
    /// PTX).
    pub fn open(ordinal: usize) -> Result<Self> {
        check_available()?;
        trace("CudaContext::new");
        let ctx = CudaContext::new(ordinal).map_err(|e| anyhow::anyhow!("opening cuda:{ordinal}: {e:?}"))?;
        ctx.bind_to_thread()
            .map_err(|e| anyhow::anyhow!("binding cuda:{ordinal}: {e:?}"))?;
        let mut stream = std::ptr::null_mut();
        ck(
            unsafe { sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) },
            "cuStreamCreate",
        )?;
        // The driver reads the fat binary's header in place: give it 8-byte aligned memory.
        let mut image = vec![0u64; FATBIN.len().div_ceil(8)];
        for (dst, src) in image.iter_mut().zip(FATBIN.chunks(8)) {
            let mut b = [0u8; 8];
            b[..src.len()].copy_from_slice(src);
            *dst = u64::from_ne_bytes(b);
        }
        trace("cuModuleLoadData");
        let mut module = std::ptr::null_mut();
        ck(
            unsafe { sys::cuModuleLoadData(&mut module, image.as_ptr() as *const c_void) },
            "loading Specula's kernels (cuModuleLoadData)",
        )?;
        let mut f = HashMap::new();
        let gemms = GEMM_NAMES.iter().flatten().flatten().map(|e| e.2);
        let pipes = GEMM_PIPE.iter().flatten().flatten().copied();
        let dbs = GEMM_DB.iter().flatten().flatten().copied();
        let seqs = GEMM_SEQ.iter().flatten().flatten().copied();
        for name in KERNELS
            .into_iter()
            .chain(gemms)
            .chain(pipes)
            .chain(dbs)
            .chain(seqs)
            .chain(GEMM_PX24.iter().flatten().copied())
        {
            let c = CString::new(name)?;
            let mut func = std::ptr::null_mut();
            ck(unsafe { sys::cuModuleGetFunction(&mut func, module, c.as_ptr()) }, name)?;
            f.insert(name, func);
        }
        let seq_smem = (GEMM_SEQ.iter().zip(GEMM_SEQ_SMEM)).flat_map(|(k, b)| k.iter().flatten().map(move |&n| (n, b)));
        let pipe_smem =
            (GEMM_PIPE.iter().zip(GEMM_PIPE_SMEM)).flat_map(|(k, b)| k.iter().flatten().map(move |&n| (n, b)));
        let px24_smem = GEMM_PX24.iter().flatten().map(|&n| (n, GEMM_PX24_SMEM));
        for (name, bytes) in pipe_smem.chain(seq_smem).chain(px24_smem) {
            let r = unsafe {
                sys::cuFuncSetAttribute(
                    f[name],
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )
            };
            ck(r, name)?;
        }
        let gemm_path = match std::env::var("SPECULA_CUDA_GEMM").as_deref() {
            Ok("gemv") => GemmPath::Gemv,
            Ok("mma") | Err(_) => GemmPath::Mma,
            Ok(other) => bail!("SPECULA_CUDA_GEMM={other}: use mma or gemv"),
        };
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| anyhow::anyhow!("reading the multiprocessor count: {e:?}"))?
            .max(1) as usize;
        let pipe = match std::env::var("SPECULA_CUDA_GEMM_PIPE").as_deref() {
            Ok("0") => 0,
            Ok("1") | Ok("w") => 1,
            Ok("px") => 2,
            Ok("px4") => 3,
            Ok("px2") => 4,
            Ok("pp") => 5,
            Err(_) | Ok("auto") => PIPE_AUTO,
            Ok(other) => bail!("SPECULA_CUDA_GEMM_PIPE={other}: use 0, w, px, px4, px2, pp or auto"),
        };
        let wide = match std::env::var("SPECULA_CUDA_GEMM_WIDE").as_deref() {
            Ok("2") | Err(_) => Wide::Tile2,
            Ok("4") => Wide::Tile4,
            Ok("seq") => Wide::Seq,
            Ok("seq32") => Wide::Seq32,
            Ok(other) => bail!("SPECULA_CUDA_GEMM_WIDE={other}: use 2, 4, seq or seq32"),
        };
        let seq_w = match std::env::var("SPECULA_CUDA_SEQ_W").as_deref() {
            Err(_) | Ok("4") => SeqWeights::Reg4,
            Ok("6") => SeqWeights::Reg6,
            Ok("ring") => SeqWeights::Ring,
            Ok(other) => bail!("SPECULA_CUDA_SEQ_W={other}: use 4, 6 or ring"),
        };
        let seq_blocks = match std::env::var("SPECULA_CUDA_SEQ_BLOCKS") {
            Ok(v) => match v.parse::<usize>() {
                Ok(b @ 1..=SEQ_MAX_TILES) => b,
                _ => bail!("SPECULA_CUDA_SEQ_BLOCKS={v}: use 1..={SEQ_MAX_TILES}"),
            },
            Err(_) => SEQ_BLOCKS,
        };
        let seq_part = DevBuf::new(SEQ_MAX_TILES * SEQ_TILE_PART_BYTES)?;
        let seq_count = DevBuf::new(SEQ_MAX_TILES * 4)?;
        let gpu = Self {
            capturing: std::cell::Cell::new(false),
            ctx,
            stream,
            module,
            f,
            gemm_path: std::cell::Cell::new(gemm_path),
            wide: std::cell::Cell::new(wide),
            seq_blocks: std::cell::Cell::new(seq_blocks),
            seq_w: std::cell::Cell::new(seq_w),
            seq_part,
            seq_count,
            pipe: std::cell::Cell::new(pipe),
            sms,
            narrow64: std::cell::Cell::new(std::env::var("SPECULA_CUDA_NARROW64").is_ok_and(|v| v == "1")),
            profile_tag: std::cell::RefCell::new(String::new()),
            db_from_nt: std::cell::Cell::new(match std::env::var("SPECULA_CUDA_GEMM1").as_deref() {
                Ok("db") => 1,
                Ok("plain") => 3,
                _ => 2,
            }),
            pdl: std::env::var("SPECULA_CUDA_PDL").map_or(true, |v| v != "0"),
            profile: std::cell::RefCell::new(None),
        };
        gpu.upload(gpu.seq_count.at(0), &[0i32; SEQ_MAX_TILES])?;
        gpu.synchronize()?;
        Ok(gpu)
    }

    /// Make this GPU's context current on the calling thread (CUDA driver calls act on the
    /// thread's current context; a model built on one thread and run on another needs this).
    pub fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| anyhow::anyhow!("binding the CUDA context to this thread: {e:?}"))
    }

    /// Device name, e.g. "NVIDIA H200".
    pub fn name(&self) -> String {
        self.ctx.name().unwrap_or_else(|_| "unknown".into())
    }

    /// The driver's CUDA version, e.g. 13000.
    pub fn driver_version(&self) -> i32 {
        let mut v = 0;
        unsafe {
            sys::cuDriverGetVersion(&mut v);
        }
        v
    }

    pub fn total_memory(&self) -> usize {
        self.ctx.total_mem().unwrap_or(0)
    }

    /// Bytes of device memory free now (`cuMemGetInfo`).
    pub fn free_memory(&self) -> Result<usize> {
        let (mut free, mut total) = (0usize, 0usize);
        ck(unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) }, "cuMemGetInfo")?;
        Ok(free)
    }

    fn func(&self, name: &str) -> Result<(&'static str, sys::CUfunction)> {
        self.f
            .get_key_value(name)
            .map(|(k, v)| (*k, *v))
            .ok_or_else(|| anyhow::anyhow!("kernel {name} not loaded"))
    }

    pub fn gemm_path(&self) -> GemmPath {
        self.gemm_path.get()
    }

    /// The GEMM kernel above 32 rows (speed only: the same bits).
    pub fn wide(&self) -> Wide {
        self.wide.get()
    }

    pub fn set_wide(&self, wide: Wide) {
        self.wide.set(wide);
    }

    /// [`Gpu::seq_blocks`]: blocks a [`Wide::Seq`] GEMM aims for (clamped to 1..=256).
    pub fn set_seq_blocks(&self, blocks: usize) {
        self.seq_blocks.set(blocks.clamp(1, SEQ_MAX_TILES));
    }

    /// [`Gpu::pipe`] (0..=[`PIPE_AUTO`]; speed only).
    pub fn set_pipe(&self, p: u8) {
        self.pipe.set(p.min(PIPE_AUTO));
    }

    pub fn pipe(&self) -> u8 {
        self.pipe.get()
    }

    /// [`Gpu::narrow64`] (speed only).
    pub fn set_narrow64(&self, on: bool) {
        self.narrow64.set(on);
    }

    pub fn narrow64(&self) -> bool {
        self.narrow64.get()
    }

    /// [`Gpu::seq_w`] (speed only).
    pub fn set_seq_w(&self, w: SeqWeights) {
        self.seq_w.set(w);
    }

    pub fn seq_w(&self) -> SeqWeights {
        self.seq_w.get()
    }

    pub fn seq_blocks(&self) -> usize {
        self.seq_blocks.get()
    }

    /// Start bracketing every launch with CUDA events (not while capturing a graph).
    pub fn start_profile(&self) {
        *self.profile.borrow_mut() = Some(Vec::new());
    }

    /// Stop profiling: wait for the stream and sum the event timings per kernel.
    pub fn finish_profile(&self) -> Result<Profile> {
        let Some(events) = self.profile.borrow_mut().take() else {
            return Ok(Vec::new());
        };
        self.synchronize()?;
        let mut out: Profile = Vec::new();
        for (name, a, b) in events {
            let mut ms = 0f32;
            let r = unsafe { sys::cuEventElapsedTime_v2(&mut ms, a, b) };
            unsafe {
                sys::cuEventDestroy_v2(a);
                sys::cuEventDestroy_v2(b);
            }
            ck(r, "cuEventElapsedTime")?;
            match out.iter_mut().find(|e| e.0 == name) {
                Some(e) => {
                    e.1 += 1;
                    e.2 += ms as f64;
                }
                None => out.push((name.to_string(), 1, ms as f64)),
            }
        }
        out.sort_by(|a, b| b.2.total_cmp(&a.2));
        Ok(out)
    }

    fn record_event(&self) -> Result<sys::CUevent> {
        let mut e = std::ptr::null_mut();
        ck(unsafe { sys::cuEventCreate(&mut e, 0) }, "cuEventCreate")?;
        ck(unsafe { sys::cuEventRecord(e, self.stream) }, "cuEventRecord")?;
        Ok(e)
    }

    pub(crate) fn launch(&self, name: &str, grid: (u32, u32), block: u32, args: &[A]) -> Result<()> {
        self.launch_smem(name, grid, block, 0, args)
    }

    /// [`Gpu::launch`] with `smem` bytes of dynamic shared memory (the kernel's limit is raised
    /// to what it needs when the module loads).
    pub(crate) fn launch_smem(&self, name: &str, grid: (u32, u32), block: u32, smem: u32, args: &[A]) -> Result<()> {
        self.launch3(name, (grid.0, grid.1, 1), block, smem, args)
    }

    /// [`Gpu::launch_smem`] with a three-dimensional grid.
    pub(crate) fn launch3(&self, name: &str, grid: (u32, u32, u32), block: u32, smem: u32, args: &[A]) -> Result<()> {
        let (name, f) = self.func(name)?;
        let profiling = self.profile.borrow().is_some() && !self.capturing.get();
        let ev0 = if profiling { Some(self.record_event()?) } else { None };
        if sync_each() {
            trace(&format!("launch {name} grid {grid:?} block {block}"));
        }
        let mut vals: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                A::P(p) | A::U64(p) => p,
                A::I(i) => i as u32 as u64,
                A::F(x) => x.to_bits() as u64,
            })
            .collect();
        let mut ptrs: Vec<*mut c_void> = vals.iter_mut().map(|v| v as *mut u64 as *mut c_void).collect();
        let r = if self.pdl {
            // SAFETY: a zeroed attribute is valid plain data; the id and value set are the
            // documented pair for programmatic stream serialization.
            let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.programmaticStreamSerializationAllowed = 1;
            let cfg = sys::CUlaunchConfig {
                gridDimX: grid.0,
                gridDimY: grid.1,
                gridDimZ: grid.2,
                blockDimX: block,
                blockDimY: 1,
                blockDimZ: 1,
                sharedMemBytes: smem,
                hStream: self.stream,
                attrs: &mut attr,
                numAttrs: 1,
            };
            unsafe { sys::cuLaunchKernelEx(&cfg, f, ptrs.as_mut_ptr(), std::ptr::null_mut()) }
        } else {
            unsafe {
                sys::cuLaunchKernel(
                    f,
                    grid.0,
                    grid.1,
                    grid.2,
                    block,
                    1,
                    1,
                    smem,
                    self.stream,
                    ptrs.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            }
        };
        if let Err(e) = ck(r, name) {
            if let Some(a) = ev0 {
                unsafe {
                    sys::cuEventDestroy_v2(a);
                }
            }
            return Err(e);
        }
        if let Some(a) = ev0 {
            let b = self.record_event()?;
            if let Some(p) = self.profile.borrow_mut().as_mut() {
                let tag = std::mem::take(&mut *self.profile_tag.borrow_mut());
                p.push((if tag.is_empty() { name.to_string() } else { tag }, a, b));
            }
        }
        if sync_each() && !self.capturing.get() {
            self.synchronize()?;
        }
        Ok(())
    }

    pub fn synchronize(&self) -> Result<()> {
        ck(unsafe { sys::cuStreamSynchronize(self.stream) }, "cuStreamSynchronize")
    }

    /// Copy `src` to device address `dst` (ordered on the stream; returns once `src` is staged).
    pub fn upload<T: Copy>(&self, dst: u64, src: &[T]) -> Result<()> {
        ck(
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    dst,
                    src.as_ptr() as *const c_void,
                    std::mem::size_of_val(src),
                    self.stream,
                )
            },
            "cuMemcpyHtoDAsync",
        )
    }

    /// Copy from device address `src` into `dst`, waiting for the stream.
    pub fn download<T: Copy>(&self, dst: &mut [T], src: u64) -> Result<()> {
        trace_always("download");
        ck(
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    dst.as_mut_ptr() as *mut c_void,
                    src,
                    std::mem::size_of_val(dst),
                    self.stream,
                )
            },
            "cuMemcpyDtoHAsync",
        )?;
        self.synchronize()
    }

    pub fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        ck(
            unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, self.stream) },
            "cuMemcpyDtoDAsync",
        )
    }

    /// Fill `n` bf16 values at `dst` with `offset + scale * U(-1, 1)` from `seed` (on the device).
    pub fn fill_uniform_bf16(&self, dst: u64, n: usize, seed: u64, scale: f32, offset: f32) -> Result<()> {
        let blocks = (n.div_ceil(256)).min(65536) as u32;
        self.launch(
            "fill_uniform_bf16",
            (blocks, 1),
            256,
            &[A::P(dst), A::U64(n as u64), A::U64(seed), A::F(scale), A::F(offset)],
        )
    }

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
    fn gemv(&self, w: u64, x: u64, r: Option<u64>, y: u64, rows: usize, n: usize, k: usize) -> Result<()> {
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

    /// Fill a Q8_0 [`Mat`] of `n` values in rows of `k` with random int8 values and per-chunk
    /// scales `scale · (1 + U(-0.5, 0.5))` (synthetic weights).
    pub fn fill_q8(&self, q: u64, d: u64, n: usize, k: usize, seed: u64, scale: f32) -> Result<()> {
        let nd = n / k * k.div_ceil(32);
        let blocks = (n.div_ceil(256)).min(65536) as u32;
        self.launch(
            "fill_q8",
            (blocks, 1),
            256,
            &[
                A::P(q),
                A::P(d),
                A::U64(n as u64),
                A::U64(nd as u64),
                A::U64(seed),
                A::F(scale),
            ],
        )
    }
}

/// The (MT, NT) tile of the GEMM for `rows` input rows: 16·MT features by 8·NT rows per block.
/// Any choice gives the same bits (the fold order depends on K only); this one is for speed.
fn gemm_tile(rows: usize, wide_mt: usize) -> (usize, usize) {
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
const GEMM_SEQ: [[[&str; 2]; 2]; 4] = [
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
const GEMM_SEQ_SMEM: [u32; 4] = [
    4 * 4 * 64 * 64,
    4 * 4 * 32 * 64,
    4 * 6 * 64 * 64,
    8 * 2 * (64 * 64 + 256 * 32),
];

/// Feature x row tiles (128 x 64) a `gemm_seq` launch may split over blocks (the partials
/// buffer holds this many); launches with more tiles do not split.
pub const SEQ_MAX_TILES: usize = 256;

/// Bytes of slice partials per tile: 8 slices x 128 features x 64 rows x f32.
const SEQ_TILE_PART_BYTES: usize = 8 * 128 * 64 * 4;

/// The default of [`Gpu::seq_blocks`] (132 multiprocessors on an H200).
const SEQ_BLOCKS: usize = 128;

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
const GEMM_PIPE: [[[&str; 2]; 2]; 5] = [
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
const PIPE_PP: usize = 4;

/// The 2x4 tile with its operands through a 3-stage ring (`gemm_*_2x4_px`), `[silu][q8]`.
const GEMM_PX24: [[&str; 2]; 2] = [
    ["gemm_bf16_2x4_px", "gemm_q8_2x4_px"],
    ["gemm_bf16_2x4_px_silu", "gemm_q8_2x4_px_silu"],
];

/// Dynamic shared memory of [`GEMM_PX24`]: 3 stages x (2 m-tiles x 2 rows + 4 n-tiles) x 256
/// lanes x 16 bytes.
const GEMM_PX24_SMEM: u32 = 3 * 8 * 256 * 16;

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
const GEMM_PIPE_SMEM: [u32; 5] = [
    3 * 2 * 4 * 256 * 16,
    3 * 12 * 256 * 16,
    4 * 12 * 256 * 16,
    2 * 12 * 256 * 16,
    3 * 16 * 256 * 16,
];

/// The GEMM kernel of each (MT, NT) tile.
type GemmTiles = [(usize, usize, &'static str); 5];

/// The 1x1 and 1x2 tiles with two alternating register batches (`Gpu::db_from_nt`):
/// [silu][q8][nt - 1].
const GEMM_DB: [[[&str; 2]; 2]; 2] = [
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
const GEMM_NAMES: [[GemmTiles; 2]; 2] = [
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

impl Drop for Gpu {
    fn drop(&mut self) {
        unsafe {
            sys::cuModuleUnload(self.module);
            sys::cuStreamDestroy_v2(self.stream);
        }
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
    /// `[gate; up]` rows: `[2 intermediate, hidden]`.
    pub gate_up: Mat,
    pub down: Mat,
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
        let mut b = self.final_norm.bytes() + self.embed.bytes();
        if let Some(h) = &self.lm_head {
            b += h.bytes();
        }
        for l in &self.layers {
            b += l.attn_norm.bytes()
                + l.qkv.bytes()
                + l.o.bytes()
                + l.mlp_norm.bytes()
                + l.gate_up.bytes()
                + l.down.bytes();
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

struct Scratch {
    x: DevBuf,
    xn: DevBuf,
    qkv: DevBuf,
    q: DevBuf,
    ao: DevBuf,
    gu: DevBuf,
    act: DevBuf,
    logits: DevBuf,
    scores: DevBuf,
    argmax: DevBuf,
    /// f32 `[MAX_ROWS, heads, ATT_SPLITS, head_dim + 2]`: the attention's per-range partials.
    att_part: DevBuf,
    /// i32 `[MAX_ROWS, heads]`: ranges finished per row and head (zero between launches).
    att_count: DevBuf,
    /// i32 `[3, MAX_ROWS]`: tokens, positions, slots.
    io: DevBuf,
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
const ATT_GROUP_MIN_BLOCKS: usize = 256;

/// Forwards of up to this many rows run `attention_rows_deep`: on the H200 (qwen3-8b, context
/// 128) it took batch-1 decode from 211.6 to 214.1 tok/s and 64 streams from 6,404 to 6,116.
const ATT_DEEP_ROWS: usize = 4;

impl KernelOptions {
    fn from_env() -> Result<Self> {
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

    fn skips(&self, kernel: &str) -> bool {
        self.skip.iter().any(|k| k == kernel)
    }
}

struct Kv {
    k: DevBuf,
    v: DevBuf,
    slots: usize,
    max_ctx: usize,
}

struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
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
    w: Weights,
    inv_freq: DevBuf,
    s: Scratch,
    kv: Kv,
    /// Captured graphs by (rows, whether every row is of another sequence).
    graphs: HashMap<(usize, bool), Graph>,
    /// Per slot: positions written by [`crate::device::DeviceTarget::forward`] (the engine's
    /// contract: a row's position is at most its slot's written length, so it never attends
    /// stale K/V).
    written: Vec<u32>,
    /// Use captured graphs for narrow forwards (on by default; `SPECULA_CUDA_GRAPHS=0` turns
    /// them off).
    pub use_graphs: bool,
    /// Kernel choices (from the environment; speed only).
    pub(crate) kernels: KernelOptions,
    /// Hidden-state taps of the forward being enqueued: after block `layer`, the residual
    /// stream's rows are copied to the device address (set by `forward_hidden` only).
    tap_dst: Vec<(usize, u64)>,
    /// Where those copies go: `taps × MAX_ROWS × hidden` f32, grown on demand.
    tap_buf: Option<DevBuf>,
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

    /// Bytes of the KV cache.
    pub fn kv_bytes(&self) -> usize {
        self.kv.k.bytes() * 2
    }

    fn check_rows(&self, rows: &[Row]) -> Result<()> {
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

    fn write_io(&self, rows: &[Row]) -> Result<()> {
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
    fn enqueue(&self, n: usize, logits: LogitsRows, distinct: bool) -> Result<()> {
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
        let mma = g.gemm_path() == GemmPath::Mma;
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
            if mma && fu.silu {
                let act = Epilogue::SiluMul { act: s.act.at(0) };
                g.gemm_epi(l.gate_up.ptrs(), xn, None, s.gu.at(0), n, 2 * inter, h, act)?;
            } else {
                g.gemm(l.gate_up.ptrs(), xn, None, s.gu.at(0), n, 2 * inter, h)?;
                if !fu.skips("silu") {
                    let total = n * inter;
                    g.launch(
                        "silu_mul",
                        ((total.div_ceil(256)).min(65536) as u32, 1),
                        256,
                        &[A::P(s.gu.at(0)), A::P(s.act.at(0)), A::I(inter as i32), A::I(n as i32)],
                    )?;
                }
            }
            g.gemm(l.down.ptrs(), s.act.at(0), Some(x), x, n, h, inter)?;
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

    fn capture(&self, n: usize, distinct: bool) -> Result<Graph> {
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
    fn launch_graph(&mut self, n: usize, distinct: bool) -> Result<()> {
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

    fn read_out(&self, m: usize, want_logits: bool) -> Result<StepOut> {
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
fn distinct_slots(rows: &[Row]) -> bool {
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
    fn device_rows(&self, rows: &[crate::device::DeviceRow]) -> Result<(Vec<Row>, Vec<u32>)> {
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
