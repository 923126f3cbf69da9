//! A fork-join pool for the kernels of one forward pass: helper threads that spin between jobs.
//!
//! A decode step runs ~250 small parallel operations (the projections, the attention, the LM
//! head), each a few to a few tens of microseconds, separated by short serial stretches (norms,
//! RoPE, the KV append). A general-purpose pool puts its idle workers to sleep within
//! microseconds and wakes them through the kernel, which on the 2-core VMs this runs on cost
//! more than the parallel work gained: one thread decoded SmolLM2 at 125 tok/s and two at 183,
//! with the profile full of `sched_yield` and futex wake-ups. ggml's CPU backend avoids this by
//! spinning; so does this pool. Helpers spin on the job counter for [`SPIN`] after their last
//! chunk, then park until the next job.
//!
//! [`for_each`] runs `f(0) .. f(n - 1)` on the calling thread and the helpers, claiming indices
//! from a shared counter. Which thread runs which index never changes what an index computes,
//! so the kernels' bits do not depend on the pool. A call made while the pool is busy (another
//! thread's forward pass, or a nested call inside a job) runs its indices on the calling thread.

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long an idle helper spins before it parks.
const SPIN: Duration = Duration::from_micros(300);

/// The job a call publishes: `f` as a type-erased pointer to a `&(dyn Fn(usize) + Sync)` that
/// outlives the job (the caller waits for every index before returning).
struct Shared {
    /// `generation << 32 | n << 16 | next index`, in one word so that a claim sees the job's
    /// generation and size together: a helper claims an index by advancing it, only while the
    /// generation is the one it woke for and the index is below that job's `n`. (With `n` in a
    /// word of its own, a helper late from the previous job could read the next job's larger
    /// `n` and claim an index past its own job's end, then call a closure already gone.)
    next: AtomicU64,
    /// `*const &(dyn Fn(usize) + Sync)` of the current job.
    job: AtomicUsize,
    /// Indices finished.
    done: AtomicUsize,
    /// A helper's job panicked.
    panicked: AtomicBool,
    /// Helpers parked (or about to park) on `wake`.
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
    /// One job at a time.
    busy: Mutex<()>,
}

struct Pool {
    shared: &'static Shared,
    threads: usize,
}

thread_local! {
    /// This thread is running an index of a job (nested calls run inline).
    static IN_JOB: Cell<bool> = const { Cell::new(false) };
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        // The caller included.
        let threads = configured_threads();
        let shared: &'static Shared = Box::leak(Box::new(Shared {
            next: AtomicU64::new(0),
            job: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
            busy: Mutex::new(()),
        }));
        let mut started = 1;
        for i in 1..threads {
            let spawned = std::thread::Builder::new()
                .name(format!("specula-kernel-{i}"))
                .spawn(move || helper(shared));
            if spawned.is_ok() {
                started += 1;
            }
        }
        Pool {
            shared,
            threads: started,
        }
    })
}

/// The worker threads configured for the kernels: `RAYON_NUM_THREADS` (set by `--threads`),
/// else one per logical core. Reading it starts no thread.
pub fn configured_threads() -> usize {
    std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&t| t > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Threads a [`for_each`] call can use (the caller and the helpers).
pub fn threads() -> usize {
    pool().threads
}

/// Run `f(i)` for every `i` in `0..n`, on this thread and the pool's helpers; returns when all
/// have finished. A panic in `f` is re-raised here.
pub fn for_each(n: usize, f: &(dyn Fn(usize) + Sync)) {
    if n == 0 {
        return;
    }
    let p = pool();
    if n == 1 || n > MAX_N || p.threads == 1 || IN_JOB.with(|c| c.get()) {
        return (0..n).for_each(f);
    }
    let s = p.shared;
    let _busy = match s.busy.try_lock() {
        Ok(g) => g,
        Err(std::sync::TryLockError::Poisoned(g)) => g.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => return (0..n).for_each(f),
    };
    let fref: &(dyn Fn(usize) + Sync) = f;
    let job = &fref as *const &(dyn Fn(usize) + Sync) as usize;
    s.job.store(job, SeqCst);
    s.done.store(0, SeqCst);
    s.panicked.store(false, SeqCst);
    let gen = (s.next.load(SeqCst) >> 32).wrapping_add(1) & 0xffff_ffff;
    s.next.store(gen << 32 | (n as u64) << 16, SeqCst);
    if s.sleepers.load(SeqCst) > 0 {
        let _g = s.lock.lock().unwrap_or_else(|e| e.into_inner());
        s.wake.notify_all();
    }
    // Work alongside the helpers; every claimed index counts as done, panic or not, so that
    // the wait below ends and `f` outlives every use.
    IN_JOB.with(|c| c.set(true));
    let mut first_panic = None;
    while let Some(i) = claim(s, gen) {
        if let Err(e) = catch_unwind(AssertUnwindSafe(|| f(i))) {
            first_panic.get_or_insert(e);
        }
        s.done.fetch_add(1, SeqCst);
    }
    IN_JOB.with(|c| c.set(false));
    while s.done.load(SeqCst) < n {
        std::hint::spin_loop();
    }
    if let Some(e) = first_panic {
        std::panic::resume_unwind(e);
    }
    if s.panicked.load(SeqCst) {
        panic!("a kernel thread panicked (see the message above)");
    }
}

/// Most indices of one job (they share a 16-bit field of [`Shared::next`]); a larger job runs
/// on the calling thread.
const MAX_N: usize = 0xffff;

/// Claim the next index of generation `gen`, if any is left.
fn claim(s: &Shared, gen: u64) -> Option<usize> {
    let mut cur = s.next.load(SeqCst);
    loop {
        let (n, i) = ((cur >> 16) & 0xffff, cur & 0xffff);
        if cur >> 32 != gen || i >= n {
            return None;
        }
        let i = i as usize;
        match s.next.compare_exchange_weak(cur, cur + 1, SeqCst, SeqCst) {
            Ok(_) => return Some(i),
            Err(now) => cur = now,
        }
    }
}

fn helper(s: &'static Shared) {
    IN_JOB.with(|c| c.set(true));
    let mut seen = 0u64;
    loop {
        // Wait for a new generation: spin, then park.
        let mut spun = Instant::now();
        let mut polls = 0u32;
        let gen = loop {
            let g = s.next.load(SeqCst) >> 32;
            if g != seen {
                break g;
            }
            std::hint::spin_loop();
            polls += 1;
            if polls.is_multiple_of(256) && spun.elapsed() > SPIN {
                s.sleepers.fetch_add(1, SeqCst);
                let mut guard = s.lock.lock().unwrap_or_else(|e| e.into_inner());
                while s.next.load(SeqCst) >> 32 == seen {
                    guard = s.wake.wait(guard).unwrap_or_else(|e| e.into_inner());
                }
                drop(guard);
                s.sleepers.fetch_sub(1, SeqCst);
                spun = Instant::now();
            }
        };
        seen = gen;
        while let Some(i) = claim(s, gen) {
            // SAFETY: index `i` is below the `n` of generation `gen` (read from the same word)
            // and unfinished, so the caller of that job is still waiting in `for_each` and the
            // closure behind `job` (stored before the generation was published) is alive.
            let f = unsafe { *(s.job.load(SeqCst) as *const &(dyn Fn(usize) + Sync)) };
            if catch_unwind(AssertUnwindSafe(|| f(i))).is_err() {
                s.panicked.store(true, SeqCst);
            }
            s.done.fetch_add(1, SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_index_runs_once() {
        for n in [1usize, 2, 3, 17, 1000, 70_000] {
            let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
            for_each(n, &|i| {
                hits[i].fetch_add(1, SeqCst);
            });
            assert!(hits.iter().all(|h| h.load(SeqCst) == 1), "n = {n}");
        }
    }

    /// Back-to-back jobs of alternating sizes, each with its own short-lived closure state: a
    /// helper running an index of a finished job (the race the packed `next` word prevents)
    /// would count into the wrong job or freed memory.
    #[test]
    fn back_to_back_jobs_of_different_sizes() {
        for round in 0..20_000usize {
            let n = if round % 2 == 0 { 2 } else { 2 + round % 61 };
            let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
            for_each(n, &|i| {
                hits[i].fetch_add(1, SeqCst);
            });
            assert!(hits.iter().all(|h| h.load(SeqCst) == 1), "round {round}, n = {n}");
        }
    }

    #[test]
    fn nested_and_concurrent_calls_complete() {
        let total = AtomicUsize::new(0);
        std::thread::scope(|sc| {
            for _ in 0..4 {
                sc.spawn(|| {
                    for _ in 0..50 {
                        for_each(8, &|_| {
                            for_each(3, &|_| {
                                total.fetch_add(1, SeqCst);
                            });
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(SeqCst), 4 * 50 * 8 * 3);
    }

    #[test]
    fn a_panic_reaches_the_caller_and_the_pool_still_works() {
        let r = catch_unwind(|| {
            for_each(64, &|i| {
                if i == 37 {
                    panic!("index 37");
                }
            })
        });
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        for_each(64, &|_| {
            count.fetch_add(1, SeqCst);
        });
        assert_eq!(count.load(SeqCst), 64);
    }

    #[test]
    fn helpers_wake_after_parking() {
        let count = AtomicUsize::new(0);
        for_each(16, &|_| {
            count.fetch_add(1, SeqCst);
        });
        std::thread::sleep(SPIN * 4);
        for_each(16, &|_| {
            count.fetch_add(1, SeqCst);
        });
        assert_eq!(count.load(SeqCst), 32);
    }
}
