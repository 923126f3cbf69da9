//! The CUDA runtime: the device, its module of kernels, launches, copies, device buffers.

use super::*;

pub(crate) static FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/kernels.fatbin"));

/// Row counts up to this run from a captured CUDA graph; wider forwards (prefill) launch
/// kernel by kernel.
pub const GRAPH_MAX_ROWS: usize = 64;

/// Rows one forward takes at most (prefill runs in chunks of this many).
pub const MAX_ROWS: usize = 256;

/// Key ranges a row's attention is split into at most (`ATT_SPLITS` in kernels.cu): a long
/// context is spread over that many blocks per row and head; how many run depends on the row's
/// position only.
pub(crate) const ATT_SPLITS: usize = 16;

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

pub(crate) fn sync_each() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SPECULA_CUDA_SYNC").is_ok_and(|v| v == "1"))
}

/// A line on stderr when `SPECULA_CUDA_TRACE=1`.
pub(crate) fn trace_always(what: &str) {
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
    pub(crate) ptr: sys::CUdeviceptr,
    pub(crate) bytes: usize,
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
    pub(crate) capturing: std::cell::Cell<bool>,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: sys::CUstream,
    pub(crate) module: sys::CUmodule,
    pub(crate) f: HashMap<&'static str, sys::CUfunction>,
    /// The projection kernels (`SPECULA_CUDA_GEMM=gemv` picks the reference FMA kernels).
    pub(crate) gemm_path: std::cell::Cell<GemmPath>,
    /// The GEMM kernel above 32 rows ([`Wide`], `SPECULA_CUDA_GEMM_WIDE=2|4|seq|seq32`, default
    /// 2: on the H200 (qwen3-8b bf16) the 2x8 tile with its operands through the
    /// ring beat every seq kernel at 64 rows and in prefill, 512 tokens 9,261 tok/s against
    /// 8,041 with `gemm_seq`).
    pub(crate) wide: std::cell::Cell<Wide>,
    /// How the 64-row `gemm_seq` tile holds its weights in flight ([`SeqWeights`],
    /// `SPECULA_CUDA_SEQ_W=4|6|ring`; speed only).
    pub(crate) seq_w: std::cell::Cell<SeqWeights>,
    /// [`Wide::Seq`]: the K split across blocks is the smallest of 1, 2, 4, 8 that gives at
    /// least this many blocks (`SPECULA_CUDA_SEQ_BLOCKS`, 1..=[`SEQ_MAX_TILES`]; speed only).
    pub(crate) seq_blocks: std::cell::Cell<usize>,
    /// f32 `[SEQ_MAX_TILES, 8 slices, 128 features x 64 rows]`: the slice partials of a
    /// `gemm_seq` launch split over blocks; and i32 `[SEQ_MAX_TILES]` blocks finished per tile
    /// (zero between launches).
    pub(crate) seq_part: DevBuf,
    pub(crate) seq_count: DevBuf,
    /// How the 2x8 tile streams its operands: 0 the weights through registers, 1 + i the ring
    /// kind i of [`GEMM_PIPE`], [`PIPE_AUTO`] (bf16) `_pp` for layers whose `_pp` grid has at
    /// least a block a multiprocessor, else `_px2` for launches of more blocks than
    /// multiprocessors, else `_px`; Q8_0 `_px` (`SPECULA_CUDA_GEMM_PIPE=0|w|px|px4|px2|pp|auto`,
    /// default auto; speed only).
    pub(crate) pipe: std::cell::Cell<u8>,
    /// Multiprocessors of the device.
    pub(crate) sms: usize,
    /// At 33..64 rows, layers whose 2x8 grid has at most one block a multiprocessor run the
    /// 2x4 tile with its operands through the ring ([`GEMM_PX24`]), twice the blocks
    /// (`SPECULA_CUDA_NARROW64=1`; speed only). Off by default: on the H200 (qwen3-8b bf16, 64
    /// rows) the down GEMM took 2.12 ms a step with it against 1.81 without (o 0.86
    /// against 0.88), 64 streams 7,191 against 7,642 tok/s.
    pub(crate) narrow64: std::cell::Cell<bool>,
    /// Narrow tiles of at least this many n-tiles (1: 1x1 and 1x2, 2: 1x2 only, 3: none) run
    /// with two alternating register batches ([`GEMM_DB`]; the same bits). On the H200
    /// (qwen3-8b, one call) the 1x1 tile ran 187 against 216 tok/s that way, the 1x2 tile 5-6%
    /// faster (10 and 16 rows), so the default is 2; `SPECULA_CUDA_GEMM1=db|plain` sets 1 or 3.
    pub(crate) db_from_nt: std::cell::Cell<usize>,
    /// While profiling, the label of the next launch's entry (a GEMM's shape); empty: its name.
    pub(crate) profile_tag: std::cell::RefCell<String>,
    /// Launch with programmatic dependent launch (`SPECULA_CUDA_PDL=0` turns it off): a
    /// kernel's prologue (the GEMM's first weight loads) overlaps the previous kernel's tail.
    pub(crate) pdl: bool,
    /// While set, every launch is bracketed by CUDA events (see [`Gpu::start_profile`]).
    pub(crate) profile: std::cell::RefCell<Option<Vec<LaunchEvents>>>,
}

/// Every kernel `Gpu::open` loads, besides the GEMMs of [`GEMM_NAMES`].
pub(crate) const KERNELS: [&str; 43] = [
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
    "moe_route",
    "moe_plan",
    "moe_gate_up",
    "moe_down",
    "moe_gate_up_q8",
    "moe_down_q8",
    "moe_combine",
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
pub(crate) type LaunchEvents = (String, sys::CUevent, sys::CUevent);

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

    pub(crate) fn func(&self, name: &str) -> Result<(&'static str, sys::CUfunction)> {
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

    pub(crate) fn record_event(&self) -> Result<sys::CUevent> {
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

impl Drop for Gpu {
    fn drop(&mut self) {
        unsafe {
            sys::cuModuleUnload(self.module);
            sys::cuStreamDestroy_v2(self.stream);
        }
    }
}
