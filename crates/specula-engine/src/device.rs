//! A target model that runs on an accelerator and keeps its KV cache there, in one slot per
//! sequence (the CUDA backend, [`crate::cuda::GpuModel`]).
//!
//! The engine drives such a target through [`DeviceTarget`]: every input row names its
//! sequence's slot and its position, the device writes the row's keys and values at
//! `(slot, pos)` and the row attends to its slot's positions `0..=pos`. Rollback is therefore
//! free: a rejected draft row is simply overwritten by the next row fed at that position. On
//! the host, the sequence's [`KvCache`](crate::kv_cache::KvCache) has no layers and only counts
//! committed positions.
//!
//! Exactness needs the device's kernels to give every row the same bits whatever else is in
//! the forward (row count, other sequences, positions): the CUDA kernels are built that way
//! (docs/exactness.md, docs/gpu.md), and [`CpuSlots`] is the CPU model behind the same
//! interface, which the tests use to check the engine's slot plumbing byte for byte.

use crate::kv_cache::KvCache;
use crate::model::{LogitsRows, Model};
use anyhow::{bail, Result};
use std::sync::{Arc, Mutex};

/// One input row of a device forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceRow {
    /// Token id (< vocab).
    pub token: u32,
    /// KV slot of the row's sequence (< [`DeviceTarget::slots`]).
    pub slot: u32,
    /// Position of the token in its sequence (< [`DeviceTarget::max_ctx`]).
    pub pos: u32,
}

/// What the caller needs of one row's logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowNeed {
    /// Nothing (a prompt row before the last).
    None,
    /// Only the argmax (lowest id on a tie, as [`crate::sampling::argmax`]): greedy requests
    /// without penalties, logprobs or constraints. Saves moving `vocab` floats per row.
    Argmax,
    /// The f32 logits `[vocab]`.
    Logits,
}

/// One row's result of a [`DeviceTarget::forward`].
#[derive(Clone, Debug, PartialEq)]
pub enum RowOut {
    Argmax(u32),
    Logits(Vec<f32>),
}

/// A target model that holds its KV cache in per-sequence slots.
pub trait DeviceTarget: Send {
    /// The device, for logs and `/metrics` (e.g. "NVIDIA H200 (cuda:0)").
    fn device_name(&self) -> String;
    /// Number of KV slots (sequences that can run at once).
    fn slots(&self) -> usize;
    /// Positions per slot.
    fn max_ctx(&self) -> usize;
    /// Most rows one [`DeviceTarget::forward`] takes.
    fn max_rows(&self) -> usize;
    /// Logits per row (the vocabulary size).
    fn vocab(&self) -> usize;
    /// Whether a row's bits are the same whatever else is in the forward (row count, other
    /// slots, positions): speculation and batching are exact only then.
    fn batch_invariant(&self) -> bool;
    /// One forward over `rows` (any mix of slots and positions; the rows of one slot in
    /// increasing position order). Each row's keys and values are written at `(slot, pos)`
    /// before it attends to `0..=pos` of its slot.
    ///
    /// Returns, in row order, one [`RowOut`] per row whose need is not [`RowNeed::None`].
    /// Errors: more than [`DeviceTarget::max_rows`] rows, `need` of another length, a slot,
    /// position or token out of range, a device failure.
    fn forward(&mut self, rows: &[DeviceRow], need: &[RowNeed]) -> Result<Vec<RowOut>>;

    /// One forward over `rows` (as [`DeviceTarget::forward`], KV written the same way) that
    /// returns every row's f32 logits `[rows, vocab]` and the outputs of the blocks `taps`
    /// (block indices below the layer count, as [`Model::forward`]'s taps; the last block's is
    /// the `pre_norm` hidden state), f32 `[rows, taps × hidden]` with each row's taps
    /// concatenated in the order given, both row-major. It is the teacher pass of `specula
    /// distill` on a device. Errors: as `forward`, a tap past the last block, or a target
    /// without hidden-state output (the default).
    fn forward_hidden(&mut self, rows: &[DeviceRow], taps: &[usize]) -> Result<(Vec<f32>, Vec<f32>)> {
        let _ = (rows, taps);
        bail!("{}: this device target has no hidden-state output", self.device_name())
    }
}

/// The KV slots of a [`DeviceTarget`]: which are free, and which tokens a free slot's KV still
/// holds from its last sequence (the device's prefix cache: a new sequence takes the free slot
/// sharing the longest prefix with its prompt and skips prefilling it, as llama.cpp's server
/// reuses a slot's prompt cache).
///
/// Exact: a position's K/V depends only on the tokens at and before it (the device kernels are
/// batch-invariant), so K/V left by a sequence with the same leading tokens are the bits a
/// fresh prefill would write. Committed positions are never rewritten while a sequence holds
/// its slot (rollback only drops drafts past the committed length).
#[derive(Debug, Clone)]
pub struct SlotPool {
    state: Arc<Mutex<SlotState>>,
    slots: usize,
    reuse: bool,
}

#[derive(Debug)]
struct SlotState {
    free: Vec<u32>,
    /// Per slot: the tokens at positions `0..` of its KV, recorded when its last sequence
    /// retired cleanly ([`SlotPool::remember`]); empty while held or unknown.
    held: Vec<Vec<u32>>,
    /// Per slot: when it was last released (a logical clock), to reuse the coldest slot first.
    released: Vec<u64>,
    clock: u64,
    hits: u64,
    misses: u64,
    hit_tokens: u64,
}

/// Counters of the device's slot prefix reuse.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlotReuseStats {
    /// Leases that reused at least one position.
    pub hits: u64,
    /// Leases that reused nothing.
    pub misses: u64,
    /// Prompt positions not prefilled thanks to reuse.
    pub hit_tokens: u64,
}

impl SlotPool {
    /// A pool of slots `0..slots`, all free and empty; `reuse`: hand prompts the K/V a free
    /// slot still holds (off: every sequence prefills its whole prompt).
    pub fn new(slots: usize, reuse: bool) -> Self {
        Self {
            state: Arc::new(Mutex::new(SlotState {
                free: (0..slots as u32).collect(),
                held: vec![Vec::new(); slots],
                released: vec![0; slots],
                clock: 0,
                hits: 0,
                misses: 0,
                hit_tokens: 0,
            })),
            slots,
            reuse,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Take a free slot for a sequence whose prompt is `prompt`. Returns the lease and how many
    /// leading positions of the slot hold `prompt`'s K/V already (at most `prompt.len() - 1`:
    /// the last prompt token is always fed, its logits give the first output token). `None`
    /// when every slot is held.
    ///
    /// Which slot: among the free slots whose match covers at least half of the prompt (a
    /// repeated prompt) or half of what the slot holds (a next turn of its conversation), the
    /// longest match; else an empty slot, else the least recently released one. So a short
    /// shared header, such as a chat template's, does not evict a long conversation (llama.cpp's
    /// server picks slots by a similar threshold on the prompt). Ties: the least recently
    /// released, then the lowest.
    pub fn lease(&self, prompt: &[u32]) -> Option<(SlotLease, usize)> {
        let mut st = self.lock();
        let cap = prompt.len().saturating_sub(1);
        let shared = |held: &[u32]| held.iter().zip(prompt).take_while(|(a, b)| a == b).count().min(cap);
        // (index in `free`, reusable positions, similar, empty, released, slot)
        let cands: Vec<(usize, usize, bool, bool, u64, u32)> = st
            .free
            .iter()
            .enumerate()
            .map(|(at, &s)| {
                let held = &st.held[s as usize];
                let n = if self.reuse { shared(held) } else { 0 };
                (
                    at,
                    n,
                    n > 0 && (2 * n >= held.len() || 2 * n >= cap),
                    held.is_empty(),
                    st.released[s as usize],
                    s,
                )
            })
            .collect();
        let older = |a: &(usize, usize, bool, bool, u64, u32), b: &(usize, usize, bool, bool, u64, u32)| {
            b.4.cmp(&a.4).then(b.5.cmp(&a.5))
        };
        let pick = cands
            .iter()
            .filter(|c| c.2)
            .max_by(|a, b| a.1.cmp(&b.1).then(older(a, b)))
            .or_else(|| cands.iter().filter(|c| c.3).max_by(|a, b| older(a, b)))
            .or_else(|| cands.iter().max_by(|a, b| older(a, b)))
            .copied()?;
        let (at, reuse) = (pick.0, pick.1);
        let slot = st.free.swap_remove(at);
        st.held[slot as usize].clear();
        if reuse > 0 {
            st.hits += 1;
            st.hit_tokens += reuse as u64;
        } else {
            st.misses += 1;
        }
        Some((
            SlotLease {
                slot,
                pool: self.state.clone(),
            },
            reuse,
        ))
    }

    /// Record that `slot`'s KV holds `tokens` at positions `0..tokens.len()` (the prompt and
    /// output of a sequence that retired without an error), for reuse once the slot is free.
    pub fn remember(&self, slot: u32, tokens: Vec<u32>) {
        if !self.reuse {
            return;
        }
        if let Some(h) = self.lock().held.get_mut(slot as usize) {
            *h = tokens;
        }
    }

    /// Slots currently held.
    pub fn in_use(&self) -> usize {
        self.slots - self.lock().free.len()
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// The reuse counters.
    pub fn stats(&self) -> SlotReuseStats {
        let st = self.lock();
        SlotReuseStats {
            hits: st.hits,
            misses: st.misses,
            hit_tokens: st.hit_tokens,
        }
    }
}

/// A KV slot held by one sequence; dropping it frees the slot.
#[derive(Debug)]
pub struct SlotLease {
    slot: u32,
    pool: Arc<Mutex<SlotState>>,
}

impl SlotLease {
    pub fn slot(&self) -> u32 {
        self.slot
    }
}

impl Drop for SlotLease {
    fn drop(&mut self) {
        let mut st = self.pool.lock().unwrap_or_else(|e| e.into_inner());
        st.clock += 1;
        let now = st.clock;
        st.released[self.slot as usize] = now;
        st.free.push(self.slot);
    }
}

/// The host-side cache of a sequence on a device target: no layers, it only counts the
/// committed positions (`truncate` rolls back, `advance` commits).
pub fn position_counter(capacity: usize) -> KvCache {
    KvCache::new(0, 1, 1, capacity)
}

/// One segment of a device step: `tokens` fed to `slot` at positions `start..`, with the logits
/// rows the caller wants (only their argmax when `argmax_only`).
#[derive(Debug, Clone, Copy)]
pub struct DeviceSegment<'a> {
    pub tokens: &'a [u32],
    pub slot: u32,
    pub start: usize,
    pub rows: LogitsRows,
    pub argmax_only: bool,
}

/// Run `segs` through `target` in forwards of at most `max_rows` rows (segments are kept whole
/// in one forward where they fit; a longer one is split, which is exact since each row only
/// reads its slot's earlier positions). Returns each segment's logits rows: all, the last or
/// none, as it asked.
pub fn run_segments(target: &mut dyn DeviceTarget, segs: &[DeviceSegment<'_>]) -> Result<Vec<Vec<RowOut>>> {
    let cap = target.max_rows().max(1);
    let mut out: Vec<Vec<RowOut>> = segs.iter().map(|_| Vec::new()).collect();
    // The segment of every row of the forward being built.
    let mut rows: Vec<DeviceRow> = Vec::new();
    let mut want: Vec<RowNeed> = Vec::new();
    let mut owner: Vec<usize> = Vec::new();
    let mut flush = |rows: &mut Vec<DeviceRow>, want: &mut Vec<RowNeed>, owner: &mut Vec<usize>| -> Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        let results = target.forward(rows, want)?;
        let owners = owner
            .iter()
            .zip(want.iter())
            .filter(|(_, &w)| w != RowNeed::None)
            .map(|(&o, _)| o);
        let mut got = 0;
        for (o, r) in owners.zip(results) {
            out[o].push(r);
            got += 1;
        }
        let asked = want.iter().filter(|&&w| w != RowNeed::None).count();
        if got != asked {
            bail!("the device returned {got} logits rows, {asked} were asked for");
        }
        rows.clear();
        want.clear();
        owner.clear();
        Ok(())
    };
    for (si, s) in segs.iter().enumerate() {
        if !rows.is_empty() && rows.len() + s.tokens.len() > cap {
            flush(&mut rows, &mut want, &mut owner)?;
        }
        let n = s.tokens.len();
        for (i, &token) in s.tokens.iter().enumerate() {
            if rows.len() == cap {
                flush(&mut rows, &mut want, &mut owner)?;
            }
            rows.push(DeviceRow {
                token,
                slot: s.slot,
                pos: (s.start + i) as u32,
            });
            let wanted = match s.rows {
                LogitsRows::All => true,
                LogitsRows::Last => i + 1 == n,
                LogitsRows::None => false,
            };
            want.push(match (wanted, s.argmax_only) {
                (false, _) => RowNeed::None,
                (true, true) => RowNeed::Argmax,
                (true, false) => RowNeed::Logits,
            });
            owner.push(si);
        }
    }
    flush(&mut rows, &mut want, &mut owner)?;
    Ok(out)
}

/// The CPU [`Model`] behind the [`DeviceTarget`] interface: one KV cache per slot, truncated to
/// the row's position before the row is fed. Its rows get the same bits as the CPU engine's
/// own path (the CPU kernels are batch-invariant), so tests compare the two byte for byte.
pub struct CpuSlots {
    model: Arc<Model>,
    caches: Vec<KvCache>,
    max_rows: usize,
}

impl CpuSlots {
    /// `slots` slots of the model's context length; at most `max_rows` rows per forward.
    pub fn new(model: Arc<Model>, slots: usize, max_rows: usize) -> Self {
        let caches = (0..slots).map(|_| model.new_kv_cache()).collect();
        Self {
            model,
            caches,
            max_rows,
        }
    }
}

impl DeviceTarget for CpuSlots {
    fn device_name(&self) -> String {
        "cpu (slots)".into()
    }

    fn slots(&self) -> usize {
        self.caches.len()
    }

    fn max_ctx(&self) -> usize {
        self.model.config.context_length
    }

    fn max_rows(&self) -> usize {
        self.max_rows
    }

    fn vocab(&self) -> usize {
        self.model.config.vocab_size
    }

    fn batch_invariant(&self) -> bool {
        self.model.batch_invariant()
    }

    fn forward(&mut self, rows: &[DeviceRow], want: &[RowNeed]) -> Result<Vec<RowOut>> {
        if rows.len() > self.max_rows || rows.len() != want.len() {
            bail!(
                "cpu slots: {} rows ({} flags), at most {}",
                rows.len(),
                want.len(),
                self.max_rows
            );
        }
        let mut out = Vec::new();
        self.each_run(rows, &[], |range, f| {
            for (l, w) in f.logits.to_vec2::<f32>()?.into_iter().zip(&want[range]) {
                match w {
                    RowNeed::None => {}
                    RowNeed::Argmax => out.push(RowOut::Argmax(crate::sampling::argmax(&l))),
                    RowNeed::Logits => out.push(RowOut::Logits(l)),
                }
            }
            Ok(())
        })?;
        Ok(out)
    }

    fn forward_hidden(&mut self, rows: &[DeviceRow], taps: &[usize]) -> Result<(Vec<f32>, Vec<f32>)> {
        if rows.len() > self.max_rows {
            bail!("cpu slots: {} rows, at most {}", rows.len(), self.max_rows);
        }
        let (layers, h) = (self.model.config.num_layers, self.model.config.hidden_size);
        if let Some(&bad) = taps.iter().find(|&&t| t >= layers) {
            bail!("cpu slots: hidden states of blocks 0..{layers} only, not tap {bad}");
        }
        let (mut logits, mut hidden) = (Vec::new(), Vec::new());
        self.each_run(rows, taps, |range, f| {
            logits.extend(f.logits.flatten_all()?.to_vec1::<f32>()?);
            let per_tap = f
                .hidden
                .iter()
                .map(|t| Ok(t.flatten_all()?.to_vec1::<f32>()?))
                .collect::<Result<Vec<_>>>()?;
            hidden.extend(interleave_taps(&per_tap, range.len(), h));
            Ok(())
        })?;
        Ok((logits, hidden))
    }
}

/// Rows with their taps side by side: `per_tap[i]` holds `n` rows of `h` values of tap `i`;
/// the result is `n` rows of `per_tap.len() × h` values (row-major, taps in order).
pub fn interleave_taps<T: AsRef<[f32]>>(per_tap: &[T], n: usize, h: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(n * h * per_tap.len());
    append_interleaved(&mut out, per_tap, n, h);
    out
}

/// [`interleave_taps`], appended to `out`.
pub fn append_interleaved<T: AsRef<[f32]>>(out: &mut Vec<f32>, per_tap: &[T], n: usize, h: usize) {
    if let [one] = per_tap {
        out.extend_from_slice(one.as_ref());
        return;
    }
    out.reserve(n * h * per_tap.len());
    for r in 0..n {
        for t in per_tap {
            out.extend_from_slice(&t.as_ref()[r * h..(r + 1) * h]);
        }
    }
}

impl CpuSlots {
    /// One model forward per run of consecutive positions of one slot in `rows` (that slot's
    /// cache rolled back to the run's first position first), with hidden states at `taps`;
    /// `f` gets each run's row range and output, in order.
    fn each_run(
        &mut self,
        rows: &[DeviceRow],
        taps: &[usize],
        mut f: impl FnMut(std::ops::Range<usize>, crate::model::ForwardOutput) -> Result<()>,
    ) -> Result<()> {
        let mut i = 0;
        while i < rows.len() {
            let (kv, j) = run_of(&mut self.caches, rows, i)?;
            let tokens: Vec<u32> = rows[i..j].iter().map(|r| r.token).collect();
            f(i..j, self.model.forward(&tokens, kv, LogitsRows::All, taps)?)?;
            i = j;
        }
        Ok(())
    }
}

/// The run of consecutive positions of one slot that starts at `rows[i]`: that slot's cache,
/// rolled back to the run's first position, and the end of the run.
fn run_of<'a>(caches: &'a mut [KvCache], rows: &[DeviceRow], i: usize) -> Result<(&'a mut KvCache, usize)> {
    let r0 = rows[i];
    let mut j = i + 1;
    while j < rows.len() && rows[j].slot == r0.slot && rows[j].pos == rows[j - 1].pos + 1 {
        j += 1;
    }
    let slots = caches.len();
    let Some(kv) = caches.get_mut(r0.slot as usize) else {
        bail!("slot {} out of range ({slots} slots)", r0.slot);
    };
    if r0.pos as usize > kv.len() {
        bail!(
            "slot {}: position {} past the {} positions written",
            r0.slot,
            r0.pos,
            kv.len()
        );
    }
    kv.truncate(r0.pos as usize);
    Ok((kv, j))
}
