//! Per-sequence KV cache with rollback, in fixed-size blocks from a shared pool (paged).
//!
//! Keys and values are f16 (llama.cpp's default cache type: the forward rounds K and V to f16
//! anyway, so storing them as f16 loses nothing and halves what the attention reads). A
//! sequence holds, per layer, a table of blocks of [`KV_BLOCK`] positions each; a block holds
//! its keys `[kv_head, KV_BLOCK, head_dim]`, then its values in the same order (head-major: the
//! attention walks one KV head's positions, which are contiguous this way; position-major
//! rows left two thirds of every cache line it fetched to the other heads, and a one-row
//! decode at 1,800 positions spent most of its attention waiting on them). Blocks come
//! from a [`KvPool`] shared by every sequence of a model and go back to it when a sequence
//! shrinks or ends. All blocks of a pool have one size, so freed blocks are reused as they are
//! and resident memory stays at the peak of concurrent KV instead of growing with the
//! allocator's fragmentation (vLLM's PagedAttention block table, Kwon et al. 2023, on the CPU).
//! [`KvCache::truncate`] drops the positions past a length: speculative decoding rolls back
//! rejected draft tokens with it, and whole blocks past the new length return to the pool.

use anyhow::{bail, Result};
use half::f16;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Positions per KV block (a multiple of the attention's key tile, so a tile never spans two
/// blocks).
pub const KV_BLOCK: usize = 64;

/// Bytes of one stored key or value (f16).
pub const KV_ELEM_BYTES: usize = 2;

/// Fixed-size KV blocks shared by the sequences of one model: a free list plus counters.
/// Blocks are allocated on first need and recycled, never returned to the allocator while the
/// pool lives.
#[derive(Debug)]
pub struct KvPool {
    /// Values per block: `2 * KV_BLOCK * stride` (the keys `[kv_heads, KV_BLOCK, head_dim]`,
    /// then the values in the same order).
    block_floats: usize,
    free: Mutex<Vec<Box<[f16]>>>,
    /// Blocks created so far (in use + free).
    allocated: AtomicUsize,
    in_use: AtomicUsize,
}

/// A snapshot of a pool's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct KvPoolStats {
    pub block_bytes: usize,
    /// Blocks created so far: the pool's resident size is `allocated * block_bytes`.
    pub allocated: usize,
    pub in_use: usize,
}

impl KvPool {
    /// A pool of blocks for `stride = kv_heads * head_dim` values per position.
    pub fn new(stride: usize) -> Arc<Self> {
        Arc::new(Self {
            block_floats: 2 * KV_BLOCK * stride,
            free: Mutex::new(Vec::new()),
            allocated: AtomicUsize::new(0),
            in_use: AtomicUsize::new(0),
        })
    }

    fn take(&self) -> Box<[f16]> {
        self.in_use.fetch_add(1, Ordering::Relaxed);
        {
            let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(b) = free.pop() {
                return b;
            }
            // Counted under the lock, so `reserve_bytes` sees every block.
            self.allocated.fetch_add(1, Ordering::Relaxed);
        }
        vec![f16::ZERO; self.block_floats].into_boxed_slice()
    }

    fn give(&self, b: Box<[f16]>) {
        debug_assert_eq!(b.len(), self.block_floats);
        self.in_use.fetch_sub(1, Ordering::Relaxed);
        self.free.lock().unwrap_or_else(|e| e.into_inner()).push(b);
    }

    /// Create blocks up to `bytes` of them (whole blocks) now and write every page, so the
    /// pool's resident size is reached at start and stays flat (a server with a KV budget).
    /// Returns the number of blocks created.
    pub fn reserve_bytes(&self, bytes: usize) -> usize {
        let want = bytes / (self.block_floats * KV_ELEM_BYTES);
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let have = self.allocated.load(Ordering::Relaxed);
        let n = want.saturating_sub(have);
        for _ in 0..n {
            // `resize` writes the zeros (a zeroed allocation would leave the pages untouched).
            let mut v = Vec::with_capacity(self.block_floats);
            v.resize(self.block_floats, f16::ZERO);
            free.push(v.into_boxed_slice());
        }
        self.allocated.fetch_add(n, Ordering::Relaxed);
        n
    }

    pub fn stats(&self) -> KvPoolStats {
        KvPoolStats {
            block_bytes: self.block_floats * KV_ELEM_BYTES,
            allocated: self.allocated.load(Ordering::Relaxed),
            in_use: self.in_use.load(Ordering::Relaxed),
        }
    }
}

/// Keys and values of the first `positions` positions of one layer, block by block: what the
/// attention reads. Each block's keys are `[kv_heads, KV_BLOCK, head_dim]` f16, its values the
/// same; [`KvRows::key`] / [`KvRows::value`] are position j's `head_dim` values of one KV head,
/// [`KvRows::head_run`] a run of one head's positions.
#[derive(Debug, Clone)]
pub struct KvRows<'a> {
    /// Per block: (keys, values), `kv_heads * KV_BLOCK * head_dim` values each.
    parts: Vec<(&'a [f16], &'a [f16])>,
    kv_heads: usize,
    head_dim: usize,
    positions: usize,
}

/// Position-major rows (`[positions, kv_heads, head_dim]` keys and values) copied into the
/// block layout of [`KvRows`], owned: attention tests and benchmarks build their caches with it.
#[derive(Debug, Clone)]
pub struct KvBlocks {
    blocks: Vec<(Vec<f16>, Vec<f16>)>,
    kv_heads: usize,
    head_dim: usize,
    positions: usize,
}

impl KvBlocks {
    /// Blocks holding `keys` and `values` (`[positions, kv_heads, head_dim]` each). Panics
    /// unless both have the same whole number of rows of `kv_heads * head_dim > 0` values.
    pub fn from_rows(keys: &[f16], values: &[f16], kv_heads: usize, head_dim: usize) -> Self {
        let stride = kv_heads * head_dim;
        assert!(stride > 0 && keys.len() == values.len() && keys.len().is_multiple_of(stride));
        let positions = keys.len() / stride;
        let per = KV_BLOCK * stride;
        let blocks = (0..positions.div_ceil(KV_BLOCK))
            .map(|b| {
                let (mut kb, mut vb) = (vec![f16::ZERO; per], vec![f16::ZERO; per]);
                for off in 0..KV_BLOCK.min(positions - b * KV_BLOCK) {
                    let src = (b * KV_BLOCK + off) * stride;
                    let copy = |dst: &mut [f16], src: &[f16]| dst.copy_from_slice(src);
                    put_row(&mut kb, &keys[src..src + stride], off, head_dim, &copy);
                    put_row(&mut vb, &values[src..src + stride], off, head_dim, &copy);
                }
                (kb, vb)
            })
            .collect();
        Self {
            blocks,
            kv_heads,
            head_dim,
            positions,
        }
    }

    /// The rows, for the attention.
    pub fn rows(&self) -> KvRows<'_> {
        KvRows {
            parts: self.blocks.iter().map(|(k, v)| (&k[..], &v[..])).collect(),
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            positions: self.positions,
        }
    }
}

/// Write one position's row (`[kv_heads, head_dim]`, stored by `put`: a copy or an f32 -> f16
/// conversion) at position `off` of a head-major block half (`[kv_heads, KV_BLOCK, head_dim]`).
#[inline]
fn put_row<T>(block: &mut [f16], row: &[T], off: usize, head_dim: usize, put: &impl Fn(&mut [f16], &[T])) {
    for (g, src) in row.chunks_exact(head_dim).enumerate() {
        put(&mut block[(g * KV_BLOCK + off) * head_dim..][..head_dim], src);
    }
}

impl<'a> KvRows<'a> {
    /// Position `j`'s key for KV head `g` (`head_dim` values). Panics past
    /// [`KvRows::positions`] (recycled blocks hold other sequences' old rows past the end).
    #[inline(always)]
    pub fn key(&self, j: usize, g: usize) -> &'a [f16] {
        assert!(j < self.positions, "kv rows: position {j} of {}", self.positions);
        let k = self.parts[j / KV_BLOCK].0;
        &k[(g * KV_BLOCK + j % KV_BLOCK) * self.head_dim..][..self.head_dim]
    }

    /// Position `j`'s value for KV head `g`. Panics past [`KvRows::positions`].
    #[inline(always)]
    pub fn value(&self, j: usize, g: usize) -> &'a [f16] {
        assert!(j < self.positions, "kv rows: position {j} of {}", self.positions);
        let v = self.parts[j / KV_BLOCK].1;
        &v[(g * KV_BLOCK + j % KV_BLOCK) * self.head_dim..][..self.head_dim]
    }

    /// KV head `g`'s keys and values of positions `j0 .. end` as contiguous
    /// `[end - j0, head_dim]` slices, `end` being `j1` or the end of `j0`'s block, whichever
    /// comes first: a walk over positions in runs, with one lookup per block instead of per
    /// position. Panics unless `j0 < j1 <= positions`.
    #[inline]
    pub fn head_run(&self, g: usize, j0: usize, j1: usize) -> (&'a [f16], &'a [f16], usize) {
        assert!(
            j0 < j1 && j1 <= self.positions,
            "kv rows: run {j0}..{j1} of {}",
            self.positions
        );
        let b = j0 / KV_BLOCK;
        let end = j1.min((b + 1) * KV_BLOCK);
        let (k, v) = self.parts[b];
        let base = g * KV_BLOCK;
        let range = (base + j0 % KV_BLOCK) * self.head_dim..(base + end - b * KV_BLOCK) * self.head_dim;
        (&k[range.clone()], &v[range], end)
    }

    pub fn positions(&self) -> usize {
        self.positions
    }

    /// KV heads per position.
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    /// Values per head and position.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Contiguous position-major copies `[positions, kv_heads, head_dim]` of the keys and
    /// values.
    pub fn to_vecs(&self) -> (Vec<f16>, Vec<f16>) {
        self.copy_range(0..self.positions)
    }

    /// Contiguous position-major copies `[range.len(), kv_heads, head_dim]` of the keys and
    /// values of positions `range`.
    pub fn copy_range(&self, range: std::ops::Range<usize>) -> (Vec<f16>, Vec<f16>) {
        let n = range.len() * self.kv_heads * self.head_dim;
        let (mut k, mut v) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for j in range {
            for g in 0..self.kv_heads {
                k.extend_from_slice(self.key(j, g));
                v.extend_from_slice(self.value(j, g));
            }
        }
        (k, v)
    }
}

/// Keys and values of one sequence, for every layer.
#[derive(Debug)]
pub struct KvCache {
    /// `[layer][block]`: blocks of `2 * KV_BLOCK * stride` values (the keys
    /// `[kv_heads, KV_BLOCK, head_dim]`, then the values in the same order).
    blocks: Vec<Vec<Box<[f16]>>>,
    /// Positions written per layer (committed plus appended by the forward in progress).
    filled: Vec<usize>,
    /// Committed positions (the same for every layer between forwards).
    len: usize,
    kv_heads: usize,
    head_dim: usize,
    capacity: usize,
    pool: Arc<KvPool>,
}

impl KvCache {
    /// An empty cache for `layers` layers of `kv_heads × head_dim`, holding at most `capacity`
    /// positions, with a pool of its own.
    pub fn new(layers: usize, kv_heads: usize, head_dim: usize, capacity: usize) -> Self {
        Self::with_pool(layers, kv_heads, head_dim, capacity, KvPool::new(kv_heads * head_dim))
    }

    /// An empty cache whose blocks come from `pool` (which must be for `kv_heads * head_dim`
    /// values per position).
    pub fn with_pool(layers: usize, kv_heads: usize, head_dim: usize, capacity: usize, pool: Arc<KvPool>) -> Self {
        debug_assert_eq!(pool.block_floats, 2 * KV_BLOCK * kv_heads * head_dim);
        Self {
            blocks: (0..layers).map(|_| Vec::new()).collect(),
            filled: vec![0; layers],
            len: 0,
            kv_heads,
            head_dim,
            capacity,
            pool,
        }
    }

    /// Number of committed positions.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Maximum positions (the model's context window).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Give back every block of every layer past the first `positions` positions.
    fn release_past(&mut self, positions: usize) {
        let keep = positions.div_ceil(KV_BLOCK);
        for (bl, filled) in self.blocks.iter_mut().zip(self.filled.iter_mut()) {
            *filled = (*filled).min(positions);
            while bl.len() > keep {
                if let Some(b) = bl.pop() {
                    self.pool.give(b);
                }
            }
        }
    }

    /// Keep only the first `len` positions (no-op if `len >= self.len()`).
    pub fn truncate(&mut self, len: usize) {
        if len < self.len {
            self.len = len;
            self.release_past(len);
        }
    }

    /// Drop rows appended by a forward pass that failed before [`KvCache::advance`].
    pub fn discard_uncommitted(&mut self) {
        self.release_past(self.len);
    }

    /// Drop everything.
    pub fn clear(&mut self) {
        self.len = 0;
        self.release_past(0);
    }

    /// Number of layers.
    pub fn num_layers(&self) -> usize {
        self.blocks.len()
    }

    /// Values per position per layer (`kv_heads * head_dim`).
    pub fn stride(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Bytes of the blocks this sequence holds.
    pub fn bytes(&self) -> usize {
        self.blocks.iter().map(Vec::len).sum::<usize>() * self.pool.block_floats * KV_ELEM_BYTES
    }

    /// The pool the blocks come from.
    pub fn pool(&self) -> &Arc<KvPool> {
        &self.pool
    }

    /// Append the K and V rows (`[n, kv_heads, head_dim]` each, f32, stored rounded to the
    /// nearest f16) of layer `layer` for positions `len .. len + n`. The new positions count
    /// once [`KvCache::advance`] is called after every layer has appended.
    pub fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<()> {
        self.append_with(layer, k, v, |dst, src| {
            use half::slice::HalfFloatSliceExt;
            dst.convert_from_f32_slice(src)
        })
    }

    /// [`KvCache::append`] of rows already in f16 (a prefix cache's copies).
    pub fn append_f16(&mut self, layer: usize, k: &[f16], v: &[f16]) -> Result<()> {
        self.append_with(layer, k, v, |dst, src| dst.copy_from_slice(src))
    }

    fn append_with<T>(&mut self, layer: usize, k: &[T], v: &[T], put: impl Fn(&mut [f16], &[T])) -> Result<()> {
        let (st, hd) = (self.stride(), self.head_dim);
        if k.len() != v.len() || !k.len().is_multiple_of(st) {
            bail!("kv append: bad row sizes {} / {} for stride {st}", k.len(), v.len());
        }
        if self.filled[layer] != self.len {
            bail!(
                "kv append: layer {layer} holds {} positions, expected {}",
                self.filled[layer],
                self.len
            );
        }
        let n = k.len() / st;
        if self.len + n > self.capacity {
            bail!("kv cache full ({} positions)", self.capacity);
        }
        let mut pos = self.len;
        let mut i = 0;
        while i < n {
            let (bi, off) = (pos / KV_BLOCK, pos % KV_BLOCK);
            if bi == self.blocks[layer].len() {
                let b = self.pool.take();
                self.blocks[layer].push(b);
            }
            let run = (KV_BLOCK - off).min(n - i);
            let b = &mut self.blocks[layer][bi];
            let (kb, vb) = b.split_at_mut(KV_BLOCK * st);
            for r in 0..run {
                let src = (i + r) * st;
                put_row(kb, &k[src..src + st], off + r, hd, &put);
                put_row(vb, &v[src..src + st], off + r, hd, &put);
            }
            pos += run;
            i += run;
        }
        self.filled[layer] = pos;
        Ok(())
    }

    /// Commit `n` positions appended to every layer.
    pub fn advance(&mut self, n: usize) -> Result<()> {
        let want = self.len + n;
        if let Some(f) = self.filled.iter().find(|&&f| f != want) {
            bail!("kv advance: a layer holds {f} positions, expected {want}");
        }
        self.len += n;
        Ok(())
    }

    /// Keys and values of `layer` for the first `positions` positions (committed or just
    /// appended). Panics if `positions` is past what the layer holds.
    pub fn rows(&self, layer: usize, positions: usize) -> KvRows<'_> {
        assert!(
            positions <= self.filled[layer],
            "kv rows: {positions} positions asked, layer {layer} holds {}",
            self.filled[layer]
        );
        let per = KV_BLOCK * self.stride();
        let parts = self.blocks[layer][..positions.div_ceil(KV_BLOCK)]
            .iter()
            .map(|b| (&b[..per], &b[per..]))
            .collect();
        KvRows {
            parts,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            positions,
        }
    }

    /// Contiguous position-major copies of [`KvCache::rows`]: `[positions, kv_heads, head_dim]`
    /// keys and values.
    pub fn layer_vecs(&self, layer: usize, positions: usize) -> (Vec<f16>, Vec<f16>) {
        self.rows(layer, positions).to_vecs()
    }
}

impl Clone for KvCache {
    /// A copy with blocks of its own from the same pool.
    fn clone(&self) -> Self {
        let blocks = self
            .blocks
            .iter()
            .map(|bl| {
                bl.iter()
                    .map(|b| {
                        let mut nb = self.pool.take();
                        nb.copy_from_slice(b);
                        nb
                    })
                    .collect()
            })
            .collect();
        Self {
            blocks,
            filled: self.filled.clone(),
            len: self.len,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            capacity: self.capacity,
            pool: self.pool.clone(),
        }
    }
}

impl Drop for KvCache {
    fn drop(&mut self) {
        for bl in &mut self.blocks {
            for b in bl.drain(..) {
                self.pool.give(b);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: &[f32]) -> Vec<f16> {
        x.iter().map(|&v| f16::from_f32(v)).collect()
    }

    #[test]
    fn append_advance_truncate() {
        let mut kv = KvCache::new(2, 1, 2, 8);
        for l in 0..2 {
            kv.append(l, &[1.0, 2.0, 3.0, 4.0], &[5.0, 6.0, 7.0, 8.0]).unwrap();
        }
        kv.advance(2).unwrap();
        assert_eq!(kv.len(), 2);
        assert_eq!(kv.layer_vecs(1, 2).0, h(&[1.0, 2.0, 3.0, 4.0]));
        kv.truncate(1);
        assert_eq!(kv.len(), 1);
        assert_eq!(kv.layer_vecs(0, 1).1, h(&[5.0, 6.0]));
        // A layer that did not append makes advance fail.
        kv.append(0, &[9.0, 9.0], &[9.0, 9.0]).unwrap();
        assert!(kv.advance(1).is_err());
    }

    #[test]
    fn blocks_are_head_major_and_read_back_position_major() {
        // Two KV heads of 3 values, positions across two blocks: each head's run is its own
        // contiguous rows, and the copies come back in the order they were appended.
        let (heads, hd) = (2, 3);
        let n = KV_BLOCK + 7;
        let k: Vec<f32> = (0..n * heads * hd).map(|i| i as f32).collect();
        let v: Vec<f32> = (0..n * heads * hd).map(|i| 0.5 - i as f32).collect();
        let mut kv = KvCache::new(1, heads, hd, 1000);
        kv.append(0, &k[..5 * heads * hd], &v[..5 * heads * hd]).unwrap();
        kv.advance(5).unwrap();
        kv.append(0, &k[5 * heads * hd..], &v[5 * heads * hd..]).unwrap();
        kv.advance(n - 5).unwrap();
        let r = kv.rows(0, n);
        for j in [0, 4, 5, KV_BLOCK - 1, KV_BLOCK, n - 1] {
            for g in 0..heads {
                let at = (j * heads + g) * hd;
                assert_eq!(r.key(j, g), &h(&k[at..at + hd])[..], "key {j} head {g}");
                assert_eq!(r.value(j, g), &h(&v[at..at + hd])[..], "value {j} head {g}");
            }
        }
        let (keys, values, end) = r.head_run(1, 3, n);
        assert_eq!(end, KV_BLOCK);
        for (i, j) in (3..end).enumerate() {
            assert_eq!(&keys[i * hd..][..hd], r.key(j, 1));
            assert_eq!(&values[i * hd..][..hd], r.value(j, 1));
        }
        assert_eq!(kv.layer_vecs(0, n), (h(&k), h(&v)));
        let owned = KvBlocks::from_rows(&h(&k), &h(&v), heads, hd);
        assert_eq!(owned.rows().to_vecs(), (h(&k), h(&v)));
        assert_eq!(owned.rows().key(KV_BLOCK + 2, 1), r.key(KV_BLOCK + 2, 1));
    }

    #[test]
    fn capacity_is_enforced() {
        let mut kv = KvCache::new(1, 1, 1, 2);
        assert!(kv.append(0, &[1.0, 2.0, 3.0], &[1.0, 2.0, 3.0]).is_err());
    }

    #[test]
    fn blocks_span_and_return_to_the_pool() {
        // Positions across three blocks, rows read back by position, blocks freed on
        // truncate and drop, and reused by the next sequence.
        let pool = KvPool::new(2);
        let n = 2 * KV_BLOCK + 5;
        let k: Vec<f32> = (0..n * 2).map(|i| i as f32).collect();
        let v: Vec<f32> = (0..n * 2).map(|i| -(i as f32)).collect();
        let mut kv = KvCache::with_pool(2, 1, 2, 1000, pool.clone());
        for l in 0..2 {
            // Two appends, the first ending mid-block.
            kv.append(l, &k[..10], &v[..10]).unwrap();
        }
        kv.advance(5).unwrap();
        for l in 0..2 {
            kv.append(l, &k[10..], &v[10..]).unwrap();
        }
        kv.advance(n - 5).unwrap();
        assert_eq!(pool.stats().in_use, 2 * 3);
        let r = kv.rows(1, n);
        for j in [0, 4, 5, KV_BLOCK - 1, KV_BLOCK, n - 1] {
            assert_eq!(r.key(j, 0), &h(&k[2 * j..2 * j + 2])[..]);
            assert_eq!(r.value(j, 0), &h(&v[2 * j..2 * j + 2])[..]);
        }
        assert_eq!(kv.layer_vecs(0, n), (h(&k), h(&v)));
        kv.truncate(KV_BLOCK);
        assert_eq!(pool.stats().in_use, 2);
        assert_eq!(kv.bytes(), 2 * pool.stats().block_bytes);
        let copy = kv.clone();
        assert_eq!(copy.layer_vecs(1, KV_BLOCK), kv.layer_vecs(1, KV_BLOCK));
        assert_eq!(pool.stats().in_use, 4);
        drop(copy);
        drop(kv);
        let s = pool.stats();
        assert_eq!((s.in_use, s.allocated), (0, 6));
        // Reserving tops the pool up to whole blocks of the budget, never down.
        assert_eq!(pool.reserve_bytes(8 * s.block_bytes + 1), 2);
        assert_eq!(pool.reserve_bytes(3 * s.block_bytes), 0);
        assert_eq!(pool.stats().allocated, 8);
        let mut again = KvCache::with_pool(2, 1, 2, 1000, pool.clone());
        for l in 0..2 {
            again.append(l, &k, &v).unwrap();
        }
        again.advance(n).unwrap();
        assert_eq!(pool.stats().allocated, 8, "freed blocks are reused");
    }
}
