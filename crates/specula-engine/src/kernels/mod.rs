//! Specula's own CPU kernels: the products whose reduction order the exactness promise depends on.

/// Run `$body` with the const `$r` bound to the row count `$g` (1..=8) of a tile: the
/// monomorphised tile kernels. Panics on another count.
macro_rules! by_rows {
    ($g:expr, |$r:ident| $body:expr) => {{
        macro_rules! with {
            ($n:literal) => {{
                const $r: usize = $n;
                $body
            }};
        }
        match $g {
            1 => with!(1),
            2 => with!(2),
            3 => with!(3),
            4 => with!(4),
            5 => with!(5),
            6 => with!(6),
            7 => with!(7),
            8 => with!(8),
            g => panic!("group of {g} rows"),
        }
    }};
}

pub mod kquants;
pub mod kwide;
pub mod pool;
pub mod qmatmul;

/// Which implementation of the kernels runs. Every choice gives the same bits (tested); the
/// switch exists for side-by-side speed comparisons.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelPath {
    /// The fastest the CPU supports (the default).
    Best,
    /// The K-quants' row kernels (AVX2, and AVX-512 BW where present) instead of the wide tiles,
    /// and the AVX2 tile of the 32-value kinds instead of the VNNI one: `SPECULA_KERNELS=avx2`.
    Avx2,
    /// The portable reference code: `SPECULA_KERNELS=portable`.
    Portable,
}

/// The path chosen by the `SPECULA_KERNELS` environment variable (`avx2` or `portable`; anything
/// else, or unset, is [`KernelPath::Best`]), read once.
pub fn kernel_path() -> KernelPath {
    static P: std::sync::OnceLock<KernelPath> = std::sync::OnceLock::new();
    *P.get_or_init(|| match std::env::var("SPECULA_KERNELS").as_deref() {
        Ok("avx2") => KernelPath::Avx2,
        Ok("portable") => KernelPath::Portable,
        _ => KernelPath::Best,
    })
}

/// AVX-512 F/BW/VL with VNNI, and the AVX2 + FMA + F16C set, available at run time (the 512-bit
/// multi-row kernels of both modules).
pub fn has_avx512_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| {
            qmatmul::has_avx2()
                && std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx512vl")
                && std::is_x86_feature_detected!("avx512vnni")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The kernels that run the K-quants' 16-row interleaved layout ([`kwide::KWide`]) on this CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WideIsa {
    /// AVX-512 F/BW/VL with VNNI: 16 rows per 512-bit register (`kwide::vnni`).
    Vnni,
    /// AVX2 + FMA + F16C: two halves of 8 rows (`kwide::avx2`).
    Avx2,
}

/// Which wide K-quant kernels serve on this CPU: `None` where neither instruction set is
/// available or `SPECULA_KERNELS` forces the row kernels or the portable reference.
pub(crate) fn wide_isa() -> Option<WideIsa> {
    if kernel_path() != KernelPath::Best {
        None
    } else if has_avx512_vnni() {
        Some(WideIsa::Vnni)
    } else if qmatmul::has_avx2() {
        Some(WideIsa::Avx2)
    } else {
        None
    }
}

/// Run `f` with the thread-local `key` set to `value`, restoring the previous value afterwards
/// (also on unwind): the scoped overrides of the llama.cpp emulation
/// ([`qmatmul::with_ggml_arithmetic`], [`kquants::with_llamacpp_batches`],
/// `model::attention::with_mode`).
pub(crate) fn with_thread_local<T: Copy + 'static, R>(
    key: &'static std::thread::LocalKey<std::cell::Cell<T>>,
    value: T,
    f: impl FnOnce() -> R,
) -> R {
    struct Restore<T: Copy + 'static>(&'static std::thread::LocalKey<std::cell::Cell<T>>, T);
    impl<T: Copy + 'static> Drop for Restore<T> {
        fn drop(&mut self) {
            self.0.with(|c| c.set(self.1));
        }
    }
    let _restore = Restore(key, key.with(|c| c.replace(value)));
    f()
}

/// Split `m` activation rows into `ceil(m / max)` groups of near-equal size (the larger ones
/// first): `(first row, rows)` pairs. Which group a row lands in never changes its arithmetic.
pub(crate) fn row_groups(m: usize, max: usize) -> Vec<(usize, usize)> {
    let max = max.max(1);
    let ng = m.div_ceil(max);
    let mut out = Vec::with_capacity(ng);
    let mut i = 0;
    for g in 0..ng {
        let size = m / ng + usize::from(g < m % ng);
        out.push((i, size));
        i += size;
    }
    out
}

/// Split `m` activation rows into groups of `max` from the first row (the last one shorter):
/// the grouping of the AVX2 kernels, kept as it was.
pub(crate) fn fixed_groups(m: usize, max: usize) -> Vec<(usize, usize)> {
    let max = max.max(1);
    (0..m).step_by(max).map(|i| (i, max.min(m - i))).collect()
}

/// One row-wise product `y[i, j] = f(weight row j, activation row i)` ready to run: `n` weight
/// rows of `k` inputs, `m` activation rows split into `groups` ([`row_groups`]), and the tile
/// kernel.
///
/// `kern(j0, nw, (gi, first, g), out)` computes the tile of weight rows `j0 .. j0 + nw` (`nw` ≤
/// `wtile`) and group `gi`, the `g` rows from `first`, row-major: `out[r * nw + w] = f(j0 + w, first + r)`
/// (so a kernel stores each activation row's outputs as one contiguous run). It must give
/// bitwise the same value for an element whatever tile it is computed in, which is what makes the
/// product batch-invariant (the tiling depends on `m`).
pub(crate) struct TileJob<'a> {
    n: usize,
    k: usize,
    m: usize,
    groups: Vec<(usize, usize)>,
    wtile: usize,
    #[allow(clippy::type_complexity)]
    kern: Box<dyn Fn(usize, usize, (usize, usize, usize), &mut [f32]) + Sync + 'a>,
}

impl<'a> TileJob<'a> {
    pub(crate) fn new(
        n: usize,
        k: usize,
        m: usize,
        groups: Vec<(usize, usize)>,
        wtile: usize,
        kern: impl Fn(usize, usize, (usize, usize, usize), &mut [f32]) + Sync + 'a,
    ) -> Self {
        Self {
            n,
            k,
            m,
            groups,
            wtile: wtile.max(1),
            kern: Box::new(kern),
        }
    }
}

/// Chunks of output columns per thread in [`run_jobs`]: claimed dynamically, so more chunks
/// means less waiting on the last one, at one atomic claim each.
const CHUNKS_PER_THREAD: usize = 4;

/// Weight rows whose tiles run across all row groups before the next ones (they stay in cache).
pub(crate) const PANEL: usize = 16;

/// Run several products in one parallel pass over the kernel pool ([`pool`]) and return each
/// one's `y` as `[m, n]` row-major, in order. Products of the same input (a layer's q, k and v,
/// or its gate and up) share one fork-join instead of one each. Every element is computed by its
/// product's kernel alike however the work is split, so the bits are those of each product run
/// alone.
///
/// Each product's weight rows are split into chunks of whole units (a panel of [`PANEL`] rows,
/// or one tile when there is a single row group and so no panel to keep in cache), as even as
/// the units allow; all chunks are claimed largest first, so the threads finish close together.
pub(crate) fn run_jobs(jobs: &[TileJob<'_>]) -> Vec<Vec<f32>> {
    let mut outs: Vec<Vec<f32>> = jobs.iter().map(|j| vec![0f32; j.m * j.n]).collect();
    let threads = pool::threads();
    // (job, first weight row, end)
    let mut chunks = Vec::new();
    for (ji, job) in jobs.iter().enumerate() {
        if job.m == 0 || job.n == 0 {
            continue;
        }
        let unit = if job.groups.len() == 1 { job.wtile } else { PANEL };
        let units = job.n.div_ceil(unit);
        let nc = units.min(threads * CHUNKS_PER_THREAD);
        let start = |c: usize| ((c * (units / nc) + c.min(units % nc)) * unit).min(job.n);
        chunks.extend((0..nc).map(|c| (ji, start(c), start(c + 1))));
    }
    chunks.sort_by_key(|&(_, j0, j1)| std::cmp::Reverse(j1 - j0));
    let dsts: Vec<OutPtr> = outs.iter_mut().map(|o| OutPtr(o.as_mut_ptr())).collect();
    let work = |c: usize| {
        let (ji, j0, j1) = chunks[c];
        let job = &jobs[ji];
        let (n, dst) = (job.n, dsts[ji]);
        let gmax = job.groups.iter().map(|g| g.1).max().unwrap_or(1);
        let mut stack = [0f32; 256];
        let mut heap = Vec::new();
        let buf: &mut [f32] = if job.wtile * gmax <= stack.len() {
            &mut stack
        } else {
            heap.resize(job.wtile * gmax, 0f32);
            &mut heap
        };
        let panel = if job.groups.len() == 1 { job.wtile } else { PANEL };
        for t0 in (j0..j1).step_by(panel) {
            let t1 = (t0 + panel).min(j1);
            for (gi, &(i0, g)) in job.groups.iter().enumerate() {
                for j in (t0..t1).step_by(job.wtile) {
                    let nw = job.wtile.min(t1 - j);
                    (job.kern)(j, nw, (gi, i0, g), &mut buf[..nw * g]);
                    for (r, src) in buf[..nw * g].chunks_exact(nw).enumerate() {
                        // SAFETY: `(i0 + r, j .. j + nw)` is inside the job's `[m, n]` output,
                        // and this chunk is the only writer of its columns `j0 .. j1`.
                        unsafe { dst.write_run((i0 + r) * n + j, src) };
                    }
                }
            }
        }
    };
    let work_size: usize = jobs.iter().map(|j| j.n * j.k * j.m).sum();
    if work_size >= 1 << 15 {
        pool::for_each(chunks.len(), &work);
    } else {
        (0..chunks.len()).for_each(work);
    }
    outs
}

/// An output buffer of [`run_jobs`], shared by the chunks (each writes its own columns).
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);

// SAFETY: the chunks of `run_tiles` write disjoint elements through it, and the buffer outlives
// the parallel loop.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// Copy `src` to elements `at .. at + src.len()`.
    ///
    /// # Safety
    /// The range is in bounds of the buffer and no other thread accesses it concurrently.
    unsafe fn write_run(self, at: usize, src: &[f32]) {
        std::ptr::copy_nonoverlapping(src.as_ptr(), self.0.add(at), src.len());
    }
}

/// Seconds of CPU time used by this process (wall time where that is not available): the
/// clock of the kernels' ignored speed tests.
#[cfg(test)]
pub(crate) fn cpu_seconds() -> f64 {
    #[cfg(target_os = "linux")]
    {
        #[repr(C)]
        struct Timespec {
            sec: i64,
            nsec: i64,
        }
        extern "C" {
            fn clock_gettime(clock: i32, ts: *mut Timespec) -> i32;
        }
        let mut ts = Timespec { sec: 0, nsec: 0 };
        // SAFETY: a valid out-pointer of the layout clock_gettime writes (2 = process CPU).
        unsafe { clock_gettime(2, &mut ts) };
        ts.sec as f64 + ts.nsec as f64 * 1e-9
    }
    #[cfg(not(target_os = "linux"))]
    {
        static T0: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        T0.get_or_init(std::time::Instant::now).elapsed().as_secs_f64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_groups_cover_rows_in_order() {
        for m in 0..70 {
            for max in 1..10 {
                let g = row_groups(m, max);
                assert_eq!(g.len(), m.div_ceil(max));
                let mut next = 0;
                for &(i0, s) in &g {
                    assert_eq!(i0, next);
                    assert!(s >= 1 && s <= max);
                    next += s;
                }
                assert_eq!(next, m);
            }
        }
    }

    #[test]
    fn fixed_groups_cover_rows_in_order() {
        assert_eq!(fixed_groups(9, 4), vec![(0, 4), (4, 4), (8, 1)]);
        assert_eq!(fixed_groups(8, 8), vec![(0, 8)]);
        assert!(fixed_groups(0, 4).is_empty());
    }

    #[test]
    fn run_jobs_places_every_element() {
        let shapes = [
            (37, 1, 8, 8),
            (40, 9, 4, 8),
            (16, 33, 2, 8),
            (5, 3, 1, 2),
            (100, 2, 3, 1),
        ];
        let make = |ji: usize, (n, m, wtile, gmax): (usize, usize, usize, usize)| {
            let groups = row_groups(m, gmax);
            TileJob::new(n, 1 << 14, m, groups, wtile, move |j0, nw, (_, i0, g), out| {
                for w in 0..nw {
                    for r in 0..g {
                        out[r * nw + w] = (ji * 1_000_000 + (j0 + w) * 1000 + i0 + r) as f32;
                    }
                }
            })
        };
        let check = |ji: usize, (n, m, _, _): (usize, usize, usize, usize), y: &[f32]| {
            assert_eq!(y.len(), m * n);
            for i in 0..m {
                for j in 0..n {
                    assert_eq!(
                        y[i * n + j],
                        (ji * 1_000_000 + j * 1000 + i) as f32,
                        "job {ji} n={n} m={m} [{i},{j}]"
                    );
                }
            }
        };
        // Each product alone, then all of them in one pass.
        for (ji, &sh) in shapes.iter().enumerate() {
            let y = run_jobs(&[make(ji, sh)]);
            check(ji, sh, &y[0]);
        }
        let jobs: Vec<TileJob<'_>> = shapes.iter().enumerate().map(|(ji, &sh)| make(ji, sh)).collect();
        let ys = run_jobs(&jobs);
        assert_eq!(ys.len(), shapes.len());
        for (ji, (&sh, y)) in shapes.iter().zip(&ys).enumerate() {
            check(ji, sh, y);
        }
    }
}
